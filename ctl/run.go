// Package ctl drives runs through dstack-shim and dstack-runner the way the
// dstack server does: submit a task, wait for its container, hand the job to
// the runner, stream its logs, and clean up. cmd/tandem is its front end.
package ctl

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"path"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/runnerclient"
)

// RunOptions describe one run: its task and its job. Where it runs (the
// shim, its runner's port, the dialer, the clock, what it reports to) is
// its Client's Config.
type RunOptions struct {
	Name  string
	Image string
	// RegistryUsername and RegistryPassword authenticate the image pull.
	RegistryUsername, RegistryPassword string
	GPUs                               int // -1 all, 0 none
	CPU                                float64
	Memory                             int64
	ShmSize                            int64
	PidsLimit                          int64 // 0: the shim's
	Env                                map[string]string
	WorkDir                            string
	CodeDir                            string
	// CodeLimit is the largest code archive to send, checked before the
	// task is made (0: api.MaxUpload, the runner's default; < 0: none).
	CodeLimit int64
	Mounts    []api.InstanceMountPoint
	Network   string // host or bridge
	// User is who the job runs as in the container (docker run -u): a
	// name or uid, with :group or :gid; "": the image's.
	User string
	// Privileged runs the container privileged (dstack's privileged).
	Privileged  bool
	MaxDuration time.Duration
	// SSHKeys are public keys authorized in the job container (tandem ssh).
	SSHKeys []string
	// Commands is the job's argv; none: the image's ENTRYPOINT and CMD
	// (imagecmd.go).
	Commands []string
	// Entrypoint, when not nil, replaces the image's ENTRYPOINT with
	// Commands its arguments, as docker run --entrypoint (the image's CMD
	// unused); empty with no Commands is refused.
	Entrypoint []string
	// Detach returns once the job runs, leaving the task (tandem attach,
	// logs, rm).
	Detach bool
	// Keep leaves the task once the run ends, stopped: its output, exit
	// status and task row stay until it is removed (docker run without
	// --rm). Without it the task is removed at the end (docker run --rm).
	Keep bool
	// Stdin, when set, is what the job reads on its standard input, sent
	// to its runner as it comes (docker run -i; a Tandem runner only); nil:
	// an input that ends at once (docker run without -i).
	Stdin io.Reader
	// Started, when set, is called once the job runs (e.g. to write the
	// task's SSH config entry).
	Started func(info api.TaskInfoResponse)
	Out     io.Writer // job output
	// Workers receives the other nodes' job output in a multi-node run
	// (nil: it is not shown).
	Workers io.Writer
}

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
	info   api.TaskInfoResponse // as WaitTask last saw it
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

// checkJobBody refuses, before anything is made, a job whose submit the
// runner would refuse as too large (413, once the task runs): its
// commands and environment, with the largest named.
func checkJobBody(body api.SubmitBody) error {
	b, err := json.Marshal(body)
	if err != nil {
		return fmt.Errorf("job: %w", err)
	}
	if len(b) <= api.MaxJSONBody {
		return nil
	}
	type part struct {
		what string
		size int
	}
	var parts []part
	for k, v := range body.JobSpec.Env {
		parts = append(parts, part{"env " + k, len(k) + len(v)})
	}
	cmds := 0
	for _, c := range body.JobSpec.Commands {
		cmds += len(c)
	}
	parts = append(parts, part{"the command", cmds})
	slices.SortFunc(parts, func(a, b part) int { return cmp.Compare(b.size, a.size) })
	var big []string
	for _, p := range parts[:min(len(parts), 3)] {
		big = append(big, fmt.Sprintf("%s (%s)", p.what, BytesText(uint64(p.size))))
	}
	return fmt.Errorf("job: its commands and environment take %s as the runner's submit, which takes at most %s; pass large values as files (--code, --mount) (largest: %s)",
		BytesText(uint64(len(b))), BytesText(api.MaxJSONBody), strings.Join(big, ", "))
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

// ErrNameInUse means a run's --name is a task's of the shim already.
var ErrNameInUse = errors.New("name in use")

// ErrPortsHeld means another task of the shim runs on the host network,
// where a run's runner needs the same ports.
var ErrPortsHeld = errors.New("the runner's ports are held")

// checkShimRoom refuses, before anything is made, a run the shim's tasks
// leave no room for:
//   - a name given to a run that a task of the shim has, as docker refuses
//     a container name in use until that container is removed: tandem
//     stop NAME, attach NAME and the ssh config's Host entry each want one
//     task per name. A run's own name (tandem-<id>) is not looked up: it
//     is new.
//   - a host-network run while another task of the shim runs on the host
//     network and its job has not ended: its runner holds the runner's
//     ports, and the new task's runner would wait for them (3 s) and fail.
//     A task whose job ended is no obstacle: its runner is leaving. A
//     holder is looked at again for up to holderGrace before the refusal:
//     a run -d of a short job returns as its job starts, and a second
//     run -d right after it should find that job ended, not be refused
//     for the few milliseconds it still ran.
func (c *Client) checkShimRoom(ctx context.Context, name, network string) error {
	hostNet := network == "" || network == "host"
	if name == "" && !hostNet {
		return nil
	}
	tasks, err := c.Tasks(ctx)
	if err != nil {
		return err
	}
	for _, t := range tasks {
		if name != "" && TaskName(t) == name {
			return fmt.Errorf("%w: task %s is named %q (%s): remove it (tandem rm %s) or give another --name",
				ErrNameInUse, ShortID(t.ID), name, t.Status, ShortID(t.ID))
		}
	}
	if !hostNet {
		return nil
	}
	var holders []api.TaskInfoResponse
	for _, t := range tasks {
		if holdsRunnerPorts(t) {
			holders = append(holders, t)
		}
	}
	if len(holders) == 0 {
		return nil
	}
	var holder api.TaskInfoResponse
	_ = pollPaced(ctx, c.clk, taskPace, holderGrace, func() (bool, error) {
		kept := holders[:0]
		for _, t := range holders {
			info, err := c.shim.GetTask(ctx, t.ID)
			switch {
			case errors.Is(err, api.ErrNotFound):
				continue // removed: no longer holds anything
			case err == nil:
				t = info
			}
			if holdsRunnerPorts(t) {
				kept = append(kept, t)
			}
		}
		holders = kept
		if len(holders) > 0 {
			holder = holders[0]
		}
		return len(holders) == 0, nil
	})
	if len(holders) == 0 {
		return nil
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	return withHint(HintBridgeNetwork, fmt.Errorf("%w: task %s runs on the host network (%s), and a host-network run's runner needs the same ports",
		ErrPortsHeld, DisplayName(holder), holder.Status))
}

// holderGrace is how long a run looks again at a host-network task that
// holds the runner's ports before it is refused for it.
const holderGrace = time.Second

// holdsRunnerPorts says whether t's runner holds the host's runner ports:
// t runs on the host network, is not terminated and its job has not ended.
func holdsRunnerPorts(t api.TaskInfoResponse) bool {
	return t.Status != api.TaskTerminated && onHostNetwork(t) && !JobEnded(t)
}

// onHostNetwork says whether a task runs on the host network (a shim that
// does not say, dstack's, runs its tasks there).
func onHostNetwork(t api.TaskInfoResponse) bool {
	return t.Tandem == nil || t.Tandem.NetworkMode == "" || t.Tandem.NetworkMode == "host"
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
		for _, m := range r.o.Mounts {
			if m.ReadOnly {
				return fmt.Errorf("mount %s:%s:ro: the shim at %s is dstack's, which binds every instance mount read-write: drop :ro, or run on a Tandem shim", m.InstancePath, m.Path, r.c.cfg.Shim)
			}
		}
	}
	return r.c.submitTask(ctx, taskConfig(r.o, r.id, r.name))
}

// WaitTask waits until the task runs with its ports known; a task that
// ended first is a *TaskEndedError.
//
// On the host network the runner's port is known from the task's first
// answer, so once the task is being created (its image is here) its
// runner is waited for beside it: over a long link the runner's first
// answer (a new connection, then the healthcheck) no longer follows the
// task's last poll but overlaps it. StartJob takes what it found.
func (r *Run) WaitTask(ctx context.Context) error {
	seen := func(info api.TaskInfoResponse) {
		if r.probe != nil || r.o.Network != "host" || (info.Status != api.TaskCreating && info.Status != api.TaskRunning) {
			return
		}
		pctx, cancel := context.WithCancel(ctx)
		p := &runnerProbe{done: make(chan struct{}), cancel: cancel}
		r.probe = p
		go func() {
			defer close(p.done)
			p.r, p.err = r.c.readyRunner(pctx, info, r.o.Network)
		}()
	}
	info, err := r.c.waitTask(ctx, r.id, r.o.Image, seen)
	if err == nil {
		r.info = info
		if info.Status == api.TaskTerminated {
			err = r.c.taskEnded(ctx, info, r.o.Network)
		}
	}
	if err != nil && r.probe != nil {
		r.probe.cancel()
		_, _ = r.probe.result(ctx)
		r.probe = nil
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
	if r.o.Stdin != nil {
		go r.feedStdin(ctx, runner)
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
// Remove).
func (r *Run) End(ctx context.Context, now bool) error {
	if r.o.Keep {
		return r.c.terminate(ctx, r.id, stopGrace(now))
	}
	return r.Remove(ctx, now)
}

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
func (r *Run) Execute(ctx context.Context) (Result, error) {
	ctx, cancel := r.begin(ctx)
	defer cancel(nil)
	res := Result{TaskID: r.id, Name: r.name}
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
	var err error
	res, killNow, err = r.Follow(ctx)
	return res, err
}
