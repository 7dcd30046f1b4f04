package ctl

import (
	"context"
	"errors"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/runnerclient"
)

// waitPace is how often Wait asks after a job that has not ended: a job
// that ends within moments (a script's run -d, then wait) is seen within
// 50 ms, a long one every half second.
var waitPace = pace{quick: 50 * time.Millisecond, quickFor: 5 * time.Second, every: 500 * time.Millisecond}

// Wait blocks until the job of the task ref names ends, and returns how it
// ended (Result.ExitCode is the code `tandem run` would have exited with).
// The shim's kept end is read first, then the runner's word (a peek: it
// does not take the end from `attach`); a task that ended without its job
// saying how (terminated before the job ran) returns the shim's reason,
// and one removed meanwhile (tandem stop) a stopped job.
// Ctrl-C (ctx) ends the wait with ctx's error, the job untouched.
func (c *Client) Wait(ctx context.Context, ref string) (Result, error) {
	info, err := c.Resolve(ctx, ref)
	if err != nil {
		return Result{}, err
	}
	res := Result{TaskID: info.ID, Name: TaskName(info)}
	// One runner client for the whole wait: a client per poll would leave
	// an idle connection to the runner open per poll, for 90 s each.
	var r *runnerclient.Client
	clk := c.clk
	start := clk.Now()
	for {
		switch {
		case JobEnded(info):
			res.endedWith(*info.Tandem.Job)
			return res, nil
		case info.Status == api.TaskTerminated:
			res.endedWithTask(info)
			return res, nil
		case info.Status == api.TaskRunning:
			if r == nil {
				r, _, _ = c.runner(info)
			}
			if r == nil {
				break // the runner's port is not known yet: the shim's word comes
			}
			if ev, ok := lastJobState(ctx, r); ok && ev.State.Final() {
				res.endedWith(ev)
				return res, nil
			}
		}
		select {
		case <-ctx.Done():
			return res, ctx.Err()
		case <-clk.After(waitPace.after(clk.Now().Sub(start))):
		}
		next, err := retry(ctx, clk, 2*time.Minute, func(ctx context.Context) (api.TaskInfoResponse, error) { return c.shim.GetTask(ctx, info.ID) })
		if errors.Is(err, api.ErrNotFound) {
			// Removed meanwhile (tandem stop terminates and removes): its
			// job was stopped with it.
			res.State, res.Reason = api.JobTerminated, api.ReasonTerminatedByUser
			return res, nil
		}
		if err != nil {
			return res, err
		}
		info = next
	}
}
