package ctl

// Attaching to a task's job as an onlooker: its output and its end, from
// its runner while it runs and from what its shim kept once it left.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync/atomic"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/runnerclient"
)

// Attach follows a running task's job: its output from since on (the
// start when zero) to out, until the job ends; the result carries the
// job's exit. Cancelling ctx while it follows detaches (Result.Detached),
// leaving the job running. What it has to say besides (a stream that was
// cut) goes to the client's Progress.
func (c *Client) Attach(ctx context.Context, ref string, since time.Time, out io.Writer) (Result, error) {
	info, r, addr, err := c.runnerOf(ctx, ref, "attach")
	res := Result{TaskID: info.ID, Name: TaskName(info)}
	var hcErr error
	if err == nil {
		var hc api.HealthcheckResponse
		if hc, hcErr = r.Healthcheck(ctx); hcErr == nil && hc.TaskID != "" && hc.TaskID != info.ID {
			// A runner from before tasks were named in calls.
			hcErr = fmt.Errorf("the runner there serves task %s", api.Printable(hc.TaskID))
		}
	}
	if info.ID != "" && (info.Status == api.TaskTerminated || JobEnded(info) && (err != nil || hcErr != nil)) {
		// The task or its job ended and its runner is gone: the shim kept
		// its output and its status.
		return c.attachEnded(ctx, info, out, res)
	}
	if err != nil {
		return res, err
	}
	if hcErr != nil {
		return res, withHint(HintRunnerPort, fmt.Errorf("runner of task %s at %s: %w", DisplayName(info), addr, hcErr))
	}
	var st streamState
	shown := &countingWriter{w: out}
	// No stops (attach is ended by ctx), nothing said of the stream: what
	// became of it is read from st below.
	w := jobWatch{clk: c.clk, pull: r.PeekStates, open: sinceOpener(r, since), out: shown, stream: &st}
	err = w.run(ctx, &res)
	switch {
	case ctx.Err() != nil:
	case !st.connected.Load():
		// The runner left as we attached (a detached run's runner leaves
		// at the job's end) before showing anything: the shim keeps the
		// output and the end.
		if ended, ok := c.waitJobEnd(ctx, info.ID); ok {
			return c.attachEnded(ctx, ended, out, res)
		}
		c.say.status("log stream: the runner of %s did not stream its output", DisplayName(info))
	case !st.complete.Load():
		// The stream was cut (the runner left as the job ended, with its
		// output partly sent, or before telling the end): the shim keeps
		// the whole output and the end. What was shown is not shown twice.
		if ended, ok := c.waitJobEnd(ctx, info.ID); ok {
			if since.IsZero() {
				return c.attachRest(ctx, ended, out, shown.n.Load(), res)
			}
			res.endedWith(*ended.Tandem.Job)
			c.say.status("log stream: the runner of %s left before sending all of its output (tandem logs %s has it)", DisplayName(info), DisplayName(info))
			return res, nil
		}
	case err != nil:
		// The output was shown, then the runner left before telling the
		// job's end: the shim knows it.
		if ended, ok := c.waitJobEnd(ctx, info.ID); ok {
			res.endedWith(*ended.Tandem.Job)
			return res, nil
		}
	}
	if ctx.Err() != nil {
		res.Detached, res.Interrupted = true, true
		return res, nil
	}
	if err != nil {
		return res, fmt.Errorf("%s: %w", DisplayName(info), err)
	}
	return res, nil
}

// waitJobEnd waits (10 s at most) for the shim to know a task's job ended.
func (c *Client) waitJobEnd(ctx context.Context, id string) (api.TaskInfoResponse, bool) {
	var info api.TaskInfoResponse
	err := poll(ctx, c.clk, 200*time.Millisecond, 10*time.Second, func() (bool, error) {
		var err error
		info, err = c.shim.GetTask(ctx, id)
		return err == nil && JobEnded(info), nil
	})
	return info, err == nil
}

func runnerAnswers(ctx context.Context, r *runnerclient.Client) bool {
	if r == nil {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	_, err := r.Healthcheck(ctx)
	return err == nil
}

// attachEnded prints a finished job's (or terminated task's) kept output
// from the shim and returns its end.
func (c *Client) attachEnded(ctx context.Context, info api.TaskInfoResponse, out io.Writer, res Result) (Result, error) {
	return c.attachRest(ctx, info, out, 0, res)
}

// attachRest prints a finished job's kept output from the shim, less its
// first skip bytes (shown already), and returns its final state.
func (c *Client) attachRest(ctx context.Context, info api.TaskInfoResponse, out io.Writer, skip int64, res Result) (Result, error) {
	if err := c.shim.JobLog(ctx, info.ID, &skipWriter{w: out, skip: skip}); err != nil && !errors.Is(err, api.ErrNotFound) {
		return res, fmt.Errorf("%s: %w", DisplayName(info), err)
	}
	if JobEnded(info) {
		res.endedWith(*info.Tandem.Job)
	} else {
		res.endedWithTask(info)
	}
	return res, nil
}

// skipWriter is w less the first skip bytes written to it.
type skipWriter struct {
	w    io.Writer
	skip int64
}

func (s *skipWriter) Write(p []byte) (int, error) {
	if s.skip >= int64(len(p)) {
		s.skip -= int64(len(p))
		return len(p), nil
	}
	rest := p[s.skip:]
	s.skip = 0
	if _, err := s.w.Write(rest); err != nil {
		return 0, err
	}
	return len(p), nil
}

// countingWriter is w that counts the bytes written to it.
type countingWriter struct {
	w io.Writer
	n atomic.Int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n.Add(int64(n))
	return n, err
}
