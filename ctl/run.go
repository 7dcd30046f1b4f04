// Package ctl drives runs through dstack-shim and dstack-runner the way the
// dstack server does: submit a task, wait for its container, hand the job to
// the runner, stream its logs, and clean up. cmd/tandem is its front end.
package ctl

import (
	"cmp"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"path"
	"strings"
	"sync"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/runnerclient"
)

func newID() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
}

// Run is one run, driven step by step: Submit, WaitTask, StartJob,
// Follow, then Remove; Execute takes them in order and removes the task
// whatever happens (unless detached). Stop ends it early, gracefully.
type Run struct {
	*stopper // Stop

	o      RunOptions
	c      *Client
	id     string
	name   string
	info   api.TaskInfoResponse // as the submit's answer, then WaitTask, last saw it
	runner *runnerclient.Client // set by StartJob
	probe  *runnerProbe         // set by WaitTask on the host network
	// tandemShim: the shim said it is Tandem's (its hello), which takes a
	// task's overlapping calls one at a time; dstack's exits on them.
	tandemShim bool
	logs       <-chan openedLogs // the job's output stream, dialed by StartJob
}

// runnerProbe waits for a task's runner to answer while the task is still
// being created (see WaitTask); done is closed once r or err is set.
type runnerProbe struct {
	done   chan struct{}
	cancel context.CancelFunc
	r      *runnerclient.Client
	err    error
}

// result is what the probe found, once it is done or ctx ends (then it is
// stopped, and ctx's error is the result).
func (p *runnerProbe) result(ctx context.Context) (*runnerclient.Client, error) {
	stop := context.AfterFunc(ctx, p.cancel)
	defer stop()
	<-p.done
	p.cancel()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return p.r, p.err
}

// NewRun checks o and returns its run on c's shim, not started yet.
func NewRun(c *Client, o RunOptions) (*Run, error) {
	if err := checkCommand(o); err != nil {
		return nil, err
	}
	if o.Network == "" {
		o.Network = "host"
	}
	if err := checkRun(o, c.say); err != nil {
		return nil, err
	}
	id := newID()
	name := runName(o.Name, id)
	if err := checkJobBody(jobBody(o, id, name)); err != nil {
		return nil, err
	}
	return &Run{stopper: newStopper(), o: o, c: c, id: id, name: name}, nil
}

// checkRun refuses, before anything is made, what the runner would
// refuse once the task runs: a working dir that is not absolute (or ~,
// ~/...: the login's home), a code directory it would not take (what it
// leaves out is said to s).
func checkRun(o RunOptions, s say) error {
	if wd := o.WorkDir; wd != "" && !path.IsAbs(wd) && wd != "~" && !strings.HasPrefix(wd, "~/") {
		return fmt.Errorf("--workdir %q: must be absolute (or ~/...: the login's home)", wd)
	}
	if o.Stdin != nil && o.Detach {
		return errors.New("--interactive and --detach do not go together: a detached job's input would have no one to send it")
	}
	return checkCode(o, s)
}

// runName is a run's name: the one given, else tandem- and its id's start.
func runName(given, id string) string {
	if given != "" {
		return given
	}
	return "tandem-" + id[:8]
}

// ID is the run's task id.
func (r *Run) ID() string { return r.id }

// Name is the run's name (its task's).
func (r *Run) Name() string { return r.name }

// Submit checks that the shim answers and submits the task. A submit
// repeated with the same config is a no-op on the shim, so one lost to a
// slow or restarting shim is made again.
//
// The checks before the submit are asked at once, each over its own
// connection: over a long link (tandem run --ssh from far away) each is a
// round trip. The shim's hello speaks first: an address that is no shim
// is said as that, whatever the others met.
func (r *Run) Submit(ctx context.Context) error {
	var gpuErr, roomErr, runnerErr error
	var wg sync.WaitGroup
	wg.Go(func() { gpuErr = r.c.checkGPUs(ctx, r.o.GPUs) })
	wg.Go(func() { runnerErr = r.c.checkRunner(ctx) })
	wg.Go(func() { roomErr = r.c.checkShimRoom(ctx, r.o.Name, r.o.Network) })
	hc, err := r.c.hello(ctx)
	wg.Wait()
	if err != nil {
		return err
	}
	r.c.say.status("shim %s (%s)", r.c.cfg.Shim, hc.Version)
	r.tandemShim = hc.TandemVersion != ""
	if err := cmp.Or(runnerErr, gpuErr, roomErr); err != nil {
		return err
	}
	if !r.tandemShim {
		if len(r.o.Publish) > 0 {
			return fmt.Errorf("--publish: the shim at %s is dstack's, which publishes no job ports: run on a Tandem shim, or use --network host", r.c.cfg.Shim)
		}
		for _, m := range r.o.Mounts {
			if m.ReadOnly {
				return fmt.Errorf("mount %s:%s:ro: the shim at %s is dstack's, which binds every instance mount read-write: drop :ro, or run on a Tandem shim", m.InstancePath, m.Path, r.c.cfg.Shim)
			}
		}
	}
	// On the host network the runner's port is the shim's own: a Tandem
	// shim says it in its hello and answers the submit only once the
	// task runs, so the runner is waited for beside the submit.
	if port := cmp.Or(r.c.cfg.Ports.HTTP, hc.RunnerHTTPPort); r.tandemShim && r.o.Network == "host" && port != 0 {
		r.startProbe(ctx, api.TaskInfoResponse{ID: r.id, Tandem: &api.TaskDetails{RunnerHTTPPort: port}})
	}
	info, err := r.c.submitTask(ctx, taskConfig(r.o, r.id, r.name))
	if err != nil {
		r.stopProbe(ctx)
		return err
	}
	if info.ID == r.id {
		r.info = info
	}
	return nil
}

// startProbe waits for the task's runner, found where info says, in the
// background; StartJob takes what it found.
func (r *Run) startProbe(ctx context.Context, info api.TaskInfoResponse) {
	pctx, cancel := context.WithCancel(ctx)
	p := &runnerProbe{done: make(chan struct{}), cancel: cancel}
	r.probe = p
	go func() {
		defer close(p.done)
		p.r, p.err = r.c.readyRunner(pctx, info, r.o.Network)
	}()
}

// stopProbe ends a probe that is no longer wanted.
func (r *Run) stopProbe(ctx context.Context) {
	if r.probe != nil {
		r.probe.cancel()
		_, _ = r.probe.result(ctx)
		r.probe = nil
	}
}

// WaitTask waits until the task runs with its ports known; a task that
// ended first is a *TaskEndedError.
//
// On the host network the runner's port is known before the task runs
// (a Tandem shim's hello says it; else the task's first answer), so its
// runner is waited for beside the submit, or once the task is being
// created (its image is here): over a long link the runner's first
// answer (a new connection, then the healthcheck) no longer follows the
// task's last look but overlaps it. StartJob takes what it found.
func (r *Run) WaitTask(ctx context.Context) error {
	seen := func(info api.TaskInfoResponse) {
		if r.o.Network != "host" {
			return
		}
		switch info.Status {
		case api.TaskPending, api.TaskPulling:
			// A pull may outlast the runner's wait (a minute): the probe
			// Submit began starts again once the task is being created.
			r.stopProbe(ctx)
		case api.TaskCreating, api.TaskRunning:
			if r.probe == nil {
				r.startProbe(ctx, info)
			}
		}
	}
	info, err := r.c.waitTask(ctx, r.id, r.o.Image, r.info, seen)
	if err == nil {
		r.info = info
		if info.Status == api.TaskTerminated {
			err = r.c.taskEnded(ctx, info, r.o.Network)
		}
	}
	if err != nil {
		r.stopProbe(ctx)
	}
	return err
}

// StartJob waits for the task's runner, submits the job, uploads the code
// and starts the job; from here on Stop stops the job.
func (r *Run) StartJob(ctx context.Context) error {
	var runner *runnerclient.Client
	var err error
	if p := r.probe; p != nil {
		r.probe = nil
		runner, err = p.result(ctx)
	} else {
		runner, err = r.c.readyRunner(ctx, r.info, r.o.Network)
	}
	if err != nil {
		return err
	}
	r.runner = runner
	if r.o.Stdin != nil {
		if err := stdinRunner(ctx, r.c.clk, runner); err != nil {
			return err
		}
	}
	// The output stream is dialed beside the job's start (it waits for
	// the job's output to begin): over a long link its connection no
	// longer follows the start but overlaps it. Follow reads it.
	var logs chan openedLogs
	openLogs := func() {
		if r.o.Detach {
			return
		}
		logs = make(chan openedLogs, 1)
		go func() {
			ls, err := runner.LogsWithEnd(ctx, time.Time{})
			logs <- openedLogs{ls, err}
		}()
	}
	closeLogs := func() {
		if logs != nil {
			go func() { (<-logs).close() }()
		}
	}
	body := jobBody(r.o, r.id, r.name)
	if err := r.c.imageJob(ctx, r.id, r.o, &body); err != nil {
		return err
	}
	if r.o.CodeDir == "" {
		// No code to upload: submit and start in one call (a Tandem
		// runner), the stream dialed beside it.
		openLogs()
		rr, started, told, err := runner.SubmitRun(ctx, body)
		switch {
		case err != nil:
			err = submitError(err, r.o)
		case started:
			if told {
				r.c.say.jobRunning(rr)
			}
		default:
			err = startJob(ctx, runner, r.c.say) // dstack's runner: as it expects
		}
		if err != nil {
			closeLogs()
			return err
		}
	} else {
		if err := prepareJob(ctx, runner, r.o, body); err != nil {
			return err
		}
		openLogs()
		if err := startJob(ctx, runner, r.c.say); err != nil {
			closeLogs()
			return err
		}
	}
	r.logs = logs
	if feedsTerminal(r.o) {
		go feedStdin(ctx, runner, r.o, r.c.say)
	}
	r.started()
	if r.o.Started != nil {
		r.o.Started(r.info)
	}
	return nil
}

// Follow streams the job's output and waits for its end. Stop stops the
// job gracefully; ctx ending tears it down at once (killed is then true,
// and the caller removes the task with no grace). A runner that went away
// is explained by the shim's word on the task. The caller's signals are
// its business: turn them into Stop and a cancelled context.
func (r *Run) Follow(ctx context.Context) (res Result, killed bool, err error) {
	res = Result{TaskID: r.id, Name: r.name}
	var open logOpener
	if r.logs != nil {
		open, r.logs = openedStream(r.logs), nil
	}
	res, killed, err = follow(ctx, r.c, r.runner, open, r.stops, r.o.Out, res)
	if err == nil || killed {
		return res, killed, err
	}
	// The runner is gone: the shim knows why. A runner ends before its
	// container is seen stopped (a stop's grace, Docker's own pace), so the
	// shim may still say running for a while: its word is awaited.
	var info api.TaskInfoResponse
	var gerr error
	_ = poll(ctx, r.c.clk, 200*time.Millisecond, runnerGoneWait, func() (bool, error) {
		info, gerr = retry(ctx, r.c.clk, 30*time.Second, func(ctx context.Context) (api.TaskInfoResponse, error) { return r.c.shim.GetTask(ctx, r.id) })
		return gerr != nil || info.Status == api.TaskTerminated, nil
	})
	switch {
	case errors.Is(gerr, api.ErrNotFound):
		res.State = api.JobTerminated
		return res, false, fmt.Errorf("task %s was terminated and removed by someone else (tandem stop or the server)", ShortID(r.id))
	case gerr == nil && info.Status == api.TaskTerminated:
		res.State, res.Reason, res.Message = api.JobTerminated, info.TerminationReason, info.TerminationMessage
		return res, false, fmt.Errorf("task %s was terminated: %s %s", ShortID(r.id), api.Printable(string(info.TerminationReason)), api.Printable(strings.TrimSpace(info.TerminationMessage)))
	}
	return res, false, err
}

// runnerGoneWait is how long a run whose runner went away waits for the
// shim to see its task end before it reports the runner's error as is.
const runnerGoneWait = 15 * time.Second

// Remove terminates the task (with a 5 s grace, none when now) and
// removes it; a task already gone is fine.
func (r *Run) Remove(ctx context.Context, now bool) error {
	return r.c.cleanup(ctx, r.id, stopGrace(now), r.tandemShim)
}

// End ends the run's task: stopped and kept with Keep, else removed (see
// Remove). A task that never got a container (its pull or create failed,
// or the run ended before) is removed even with Keep, as docker run
// leaves nothing when its create fails: the run has printed why, and a
// row with no container, logs or exit code to keep would only hold its
// name.
func (r *Run) End(ctx context.Context, now bool) error {
	if r.keeps() {
		return r.c.terminate(ctx, r.id, stopGrace(now))
	}
	return r.Remove(ctx, now)
}

// keeps says whether End leaves the task (keepsTask).
func (r *Run) keeps() bool { return keepsTask(r.o.Keep, r.info) }

// keepsTask is the one rule of what a run's end leaves, for a run and for
// each node of a cluster: a task is kept when the run keeps (no --rm) and
// the task got a container; one that never did is removed.
func keepsTask(keep bool, info api.TaskInfoResponse) bool { return keep && info.ContainerID != "" }

// stopGrace is the seconds a run's job gets to stop when its task is
// removed: 5, or none when the run is ended now (an interrupt, a kill).
func stopGrace(now bool) uint {
	if now {
		return 0
	}
	return 5
}

// Execute takes the run's steps in order and, unless it detaches, ends the
// task (End) whatever happened; an end that fails is reported as an
// EventTaskLeft.
func (r *Run) Execute(ctx context.Context) (res Result, err error) {
	ctx, cancel := r.begin(ctx)
	defer cancel(nil)
	res = Result{TaskID: r.id, Name: r.name}
	if err := r.Submit(ctx); err != nil {
		if res.Interrupted = interrupted(ctx); res.Interrupted {
			return res, ErrInterrupted
		}
		return res, err
	}
	// Whatever happens from here on, take the task down, unless detached.
	// An interrupt before the job ran, or a kill, removes it at once.
	killNow := false
	defer func() {
		if res.Detached {
			return
		}
		if res.Kept = r.keeps(); res.Kept {
			res.KeptNames = []string{r.name}
		}
		if err := r.End(context.WithoutCancel(ctx), killNow || res.Interrupted); err != nil {
			r.c.say.emit(Event{Kind: EventTaskLeft, Task: ShortID(r.id), Name: r.name, Shim: r.c.cfg.Shim, Err: err})
		}
	}()
	fail := func(err error) (Result, error) {
		return failEarly(ctx, r.c.say, r.o.Keep, &res, err, "task "+ShortID(r.id))
	}
	if err := r.WaitTask(ctx); err != nil {
		var ended *TaskEndedError
		if errors.As(err, &ended) {
			res.State, res.Reason, res.Message = api.JobFailed, r.info.TerminationReason, r.info.TerminationMessage
			return res, err
		}
		return fail(err)
	}
	if err := r.StartJob(ctx); err != nil {
		return fail(err)
	}
	if interrupted(ctx) { // a Stop between the job's start and the switch
		return fail(ErrInterrupted)
	}
	if r.o.Detach {
		res.Detached, res.State = true, api.JobRunning
		return res, nil
	}
	res, killNow, err = r.Follow(ctx)
	return res, err
}

// feedsTerminal says whether a run's job has a stream to feed: its
// input, or its terminal's resizes (a detached job has no one to resize).
func feedsTerminal(o RunOptions) bool {
	return o.Stdin != nil || (o.TTY != nil && o.Resizes != nil && !o.Detach)
}

// feedStdin sends the run's input and its terminal's resizes to its job
// until the input ends (the job then reads end of file) or the job no
// longer reads; a failure is told and the job goes on (it reads end of
// file, its terminal keeps its size). A runner without the stream
// (dstack's) is not resized, and not told of it: it was not asked for
// input (stdinRunner refuses that).
func feedStdin(ctx context.Context, runner *runnerclient.Client, o RunOptions, s say) {
	err := runner.FeedStdin(ctx, o.Stdin, o.Resizes)
	switch {
	case err == nil || ctx.Err() != nil:
	case o.Stdin == nil && errors.Is(err, api.ErrNotFound):
	case o.Stdin == nil:
		s.status("the job's terminal is no longer resized: %v", err)
	default:
		s.status("the job's input was cut (it reads its end): %v", err)
	}
}
