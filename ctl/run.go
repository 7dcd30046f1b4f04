// Package ctl drives runs through dstack-shim and dstack-runner the way the
// dstack server does: submit a task, wait for its container, hand the job to
// the runner, stream its logs, and clean up. cmd/tandem is its front end.
package ctl

import (
	"archive/tar"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/runnerclient"
	"github.com/tandem-run/tandem/api/shimclient"
)

// RunOptions describe one run.
type RunOptions struct {
	Shim       string // shim address, host:port
	ShimToken  string // bearer token for a shim started with --api-token
	RunnerPort int    // the runner's HTTP port on the host; 0: as the shim reports
	Name       string
	Image      string
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
	Mounts                             []api.InstanceMountPoint
	Network                            string // host or bridge
	MaxDuration                        time.Duration
	// SSHKeys are public keys authorized in the job container (tandem ssh).
	SSHKeys  []string
	Commands []string
	// Detach returns once the job runs, leaving the task (tandem attach,
	// logs, rm).
	Detach bool
	// Dial, when set, opens agent connections (e.g. a Tunnel's Dial); Shim
	// and runner addresses are then as seen from the far end.
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
	// Started, when set, is called once the job runs (e.g. to write the
	// task's SSH config entry).
	Started func(info api.TaskInfoResponse)
	Out     io.Writer // job output
	// Workers receives the other nodes' job output in a multi-node run
	// (nil: stderr).
	Workers io.Writer
	// Progress receives the run's steps (progress.go); nil: none are shown.
	Progress func(Event)
	// Clock is what waits run on (nil: the real one).
	Clock Clock
}

// Result is how a run ended.
type Result struct {
	TaskID     string
	Name       string
	State      api.JobState
	ExitStatus *int
	Reason     api.TerminationReason
	Message    string
	// Interrupted: the user's signal ended the run.
	Interrupted bool
	// Detached: the job runs on; nothing was cleaned up.
	Detached bool
}

// Exit codes of tandem itself, docker run's where docker has one.
const (
	ExitFailure     = 125 // tandem could not run the job: shim, pull, flags
	ExitInterrupted = 130 // the user's Ctrl-C (or SIGTERM) ended the run
	ExitMaxDuration = 124 // --max-duration ended the job (as timeout(1))
	ExitStopped     = 143 // someone else stopped the task (tandem stop, the server)
)

// ExitCode maps the result to a process exit code: the job's status when
// it ran (128+N when killed by signal N, as the runner reports), else one
// of the Exit* codes.
func (r Result) ExitCode() int {
	switch {
	case r.ExitStatus != nil:
		return *r.ExitStatus
	case r.State == api.JobDone:
		return 0
	case r.Interrupted:
		return ExitInterrupted
	case r.Reason == api.ReasonMaxDurationExceeded:
		return ExitMaxDuration
	case r.State == api.JobTerminated:
		return ExitStopped
	}
	return ExitFailure
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
	shim   *shimclient.Client
	id     string
	name   string
	info   api.TaskInfoResponse // as WaitTask last saw it
	runner *runnerclient.Client // set by StartJob
}

// NewRun checks o and returns its run, not started yet.
func NewRun(o RunOptions) (*Run, error) {
	if len(o.Commands) == 0 {
		return nil, errors.New("no command given")
	}
	if o.Network == "" {
		o.Network = "host"
	}
	shim, err := newShimClient(o.Shim, o.Dial, o.ShimToken)
	if err != nil {
		return nil, err
	}
	id := newID()
	return &Run{stopper: newStopper(), o: o, shim: shim, id: id, name: runName(o.Name, id)}, nil
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
func (r *Run) Submit(ctx context.Context) error {
	hc, err := helloShim(ctx, r.shim, r.o.Shim)
	if err != nil {
		return err
	}
	r.o.status("shim %s (%s)", r.o.Shim, hc.Version)
	if err := checkGPUs(ctx, r.shim, r.o.GPUs); err != nil {
		return err
	}
	return submitTask(ctx, r.shim, taskConfig(r.o, r.id, r.name))
}

// checkGPUs refuses a run that asks for GPUs the host does not have (all
// of none, or more than it has), as its shim counts them; a shim that does
// not say (dstack's) is left to decide.
func checkGPUs(ctx context.Context, shim *shimclient.Client, gpus int) error {
	if gpus == 0 {
		return nil
	}
	h, err := shim.InstanceHost(ctx)
	if err != nil {
		return nil
	}
	switch {
	case gpus < 0 && h.GPUCount == 0:
		return errors.New("--gpus all: this host has no GPUs its shim can use")
	case gpus > h.GPUCount:
		return fmt.Errorf("--gpus %d: this host has %d GPU(s)", gpus, h.GPUCount)
	}
	return nil
}

// submitTask submits cfg, again while the shim is slow or restarting (a
// repeated submit of the same config is a no-op there).
func submitTask(ctx context.Context, shim *shimclient.Client, cfg api.TaskConfig) error {
	if _, err := retry(ctx, waitPatience, func(ctx context.Context) (struct{}, error) { return struct{}{}, shim.SubmitTask(ctx, cfg) }); err != nil {
		return fmt.Errorf("the shim rejected the task: %w", err)
	}
	return nil
}

// WaitTask waits until the task runs with its ports known; a task that
// ended first is a *TaskEndedError.
func (r *Run) WaitTask(ctx context.Context) error {
	info, err := waitTask(ctx, r.shim, r.id, r.o)
	if err != nil {
		return err
	}
	r.info = info
	if info.Status == api.TaskTerminated {
		return taskEnded(info, r.o.Network)
	}
	return nil
}

// StartJob waits for the task's runner, submits the job, uploads the code
// and starts the job; from here on Stop stops the job.
func (r *Run) StartJob(ctx context.Context) error {
	runner, err := readyRunner(ctx, r.o.Clock, r.shim, r.o.Shim, r.info, r.o.Network, r.o.RunnerPort, r.o.Dial)
	if err != nil {
		return err
	}
	r.runner = runner
	if err := submitJob(ctx, runner, r.o, r.id, r.name); err != nil {
		return err
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
	res, killed, err = follow(ctx, r.runner, r.stops, r.o, res)
	if err == nil || killed {
		return res, killed, err
	}
	// The runner is gone: the shim knows why.
	info, gerr := retry(ctx, 30*time.Second, func(ctx context.Context) (api.TaskInfoResponse, error) { return r.shim.GetTask(ctx, r.id) })
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

// Remove terminates the task (with a 5 s grace, none when now) and
// removes it; a task already gone is fine.
func (r *Run) Remove(ctx context.Context, now bool) error {
	return cleanup(ctx, r.shim, r.id, stopGrace(now))
}

// stopGrace is the seconds a run's job gets to stop when its task is
// removed: 5, or none when the run is ended now (an interrupt, a kill).
func stopGrace(now bool) uint {
	if now {
		return 0
	}
	return 5
}

// Execute takes the run's steps in order and, unless it detaches, removes
// the task at the end whatever happened; a removal that fails is reported
// as an EventTaskLeft.
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
		if err := r.Remove(context.WithoutCancel(ctx), killNow || res.Interrupted); err != nil {
			r.o.emit(Event{Kind: EventTaskLeft, Task: ShortID(r.id), Name: r.name, Shim: r.o.Shim, Err: err})
		}
	}()
	fail := func(err error) (Result, error) { return failEarly(ctx, r.o, &res, err, "task "+ShortID(r.id)) }
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

// helloShim checks that addr answers as a dstack-shim.
func helloShim(ctx context.Context, shim *shimclient.Client, addr string) (api.HealthcheckResponse, error) {
	hc, err := shim.Healthcheck(ctx)
	if err != nil {
		return hc, fmt.Errorf("shim at %s is not reachable (%w); is dstack-shim running there?", addr, err)
	}
	if hc.Service != api.ServiceShim {
		return hc, fmt.Errorf("%s answers as %q, not dstack-shim", addr, hc.Service)
	}
	return hc, nil
}

// taskConfig is the shim task of a run's job.
func taskConfig(o RunOptions, id, name string) api.TaskConfig {
	return api.TaskConfig{ID: id, Name: name, ImageName: o.Image, RegistryUsername: o.RegistryUsername, RegistryPassword: o.RegistryPassword, GPU: o.GPUs, CPU: o.CPU, Memory: o.Memory,
		ShmSize: o.ShmSize, PidsLimit: o.PidsLimit, NetworkMode: o.Network, InstanceMounts: o.Mounts, ContainerSSHKeys: o.SSHKeys}
}

// taskEnded says why a task ended before its job started: the shim's
// reason and the container's last lines (escaped per line), with a hint
// for the host-network port clash.
func taskEnded(info api.TaskInfoResponse, network string) error {
	err := error(&TaskEndedError{Info: info})
	if network != "bridge" && strings.Contains(info.TerminationMessage, "address already in use") {
		return withHint(HintBridgeNetwork, err)
	}
	return err
}

// printableLines is msg trimmed, each line made printable.
func printableLines(msg string) string {
	var lines []string
	for _, l := range strings.Split(strings.TrimSpace(msg), "\n") {
		lines = append(lines, api.Printable(l))
	}
	return strings.Join(lines, "\n")
}

// readyRunner is a client of the task's runner once it answers.
// While it does not, the task is looked at once a second: a task that
// ended (its runner could not start) is that error.
func readyRunner(ctx context.Context, clk Clock, shim *shimclient.Client, shimAddr string, info api.TaskInfoResponse, network string, port int, dial func(context.Context, string, string) (net.Conn, error)) (*runnerclient.Client, error) {
	r, addr, err := runnerFor(shimAddr, info, port, dial)
	if err != nil {
		return nil, err
	}
	ended := func(ctx context.Context) error {
		if now, err := shim.GetTask(ctx, info.ID); err == nil && now.Status == api.TaskTerminated {
			return taskEnded(now, network)
		}
		return nil
	}
	if err := waitRunner(ctx, clk, r, info.ID, ended); err != nil {
		var te *TaskEndedError
		if errors.As(err, &te) {
			return nil, err
		}
		return nil, withHint(HintRunnerPort, fmt.Errorf("runner at %s did not answer: %w", addr, err))
	}
	return r, nil
}

// cleanup terminates and removes a task, retrying transient failures for
// cleanupPatience; a task already gone is fine.
func cleanup(ctx context.Context, shim *shimclient.Client, id string, timeout uint) error {
	_, err := retry(ctx, cleanupPatience, func(ctx context.Context) (api.TaskInfoResponse, error) {
		return shim.TerminateTask(ctx, id, api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser, Timeout: timeout})
	})
	if err != nil && !errors.Is(err, api.ErrNotFound) {
		return fmt.Errorf("terminate: %w", err)
	}
	_, err = retry(ctx, cleanupPatience, func(ctx context.Context) (struct{}, error) { return struct{}{}, shim.RemoveTask(ctx, id) })
	if err != nil && !errors.Is(err, api.ErrNotFound) {
		return fmt.Errorf("remove: %w", err)
	}
	return nil
}

func interrupted(ctx context.Context) bool { return errors.Is(context.Cause(ctx), ErrInterrupted) }

// failEarly ends a run before its job ended: when the user interrupted it,
// res says so and the error is ErrInterrupted (what is removed, named by
// removing, is said); otherwise err as it is.
func failEarly(ctx context.Context, o RunOptions, res *Result, err error, removing string) (Result, error) {
	if !interrupted(ctx) {
		return *res, err
	}
	res.Interrupted, res.State = true, api.JobTerminated
	o.status("interrupted: removing %s", removing)
	return *res, ErrInterrupted
}

func waitTask(ctx context.Context, shim *shimclient.Client, id string, o RunOptions) (api.TaskInfoResponse, error) {
	var last api.TaskStatus
	start, phase := time.Now(), time.Now()
	for {
		info, err := retry(ctx, waitPatience, func(ctx context.Context) (api.TaskInfoResponse, error) { return shim.GetTask(ctx, id) })
		if err != nil {
			return info, fmt.Errorf("task %s: %w", id, err)
		}
		if info.Status != last {
			if last != "" {
				o.emit(Event{Kind: EventPhaseDone, Task: id[:8], Status: last, Took: time.Since(phase)})
			}
			phase, last = time.Now(), info.Status
		}
		if p := info.ImagePullProgress; p != nil && info.Status == api.TaskPulling && p.TotalBytes > 0 {
			o.emit(Event{Kind: EventPull, Task: id[:8], Image: o.Image, Pull: p})
		}
		if info.Status == api.TaskTerminated || (info.Status == api.TaskRunning && info.Ports != nil) {
			o.emit(Event{Kind: EventReady, Task: id[:8], Status: info.Status, Took: time.Since(start)})
			return info, nil
		}
		select {
		case <-ctx.Done():
			return info, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func waitRunner(ctx context.Context, clk Clock, r *runnerclient.Client, taskID string, ended func(context.Context) error) error {
	clk = clockOr(clk)
	lastLook := clk.Now()
	return poll(ctx, clk, 50*time.Millisecond, 60*time.Second, func() (bool, error) {
		hc, err := r.Healthcheck(ctx)
		if err == nil && hc.TaskID != "" && hc.TaskID != taskID {
			// The port's previous runner (a task that just ended) is
			// still leaving it: ours comes next.
			err = fmt.Errorf("the runner there serves task %s, not %s", api.Printable(hc.TaskID), taskID)
		}
		if err == nil {
			return true, nil
		}
		if ended != nil && clk.Now().Sub(lastLook) >= time.Second {
			lastLook = clk.Now()
			if eerr := ended(ctx); eerr != nil {
				return true, eerr
			}
		}
		return false, err
	})
}

func submitJob(ctx context.Context, r *runnerclient.Client, o RunOptions, id, name string) error {
	if err := prepareJob(ctx, r, o, jobBody(o, id, name)); err != nil {
		return err
	}
	return startJob(ctx, r, o)
}

// jobBody is the runner's submit body for a one-node run, shaped as the
// dstack server's.
func jobBody(o RunOptions, id, name string) api.SubmitBody {
	repoData := &api.RepoData{RepoType: api.RepoVirtual}
	body := api.SubmitBody{
		Run: api.Run{ID: id, RunSpec: api.RunSpec{RunName: name, RepoID: "tandem-code", RepoData: repoData}},
		JobSpec: api.JobSpec{JobsPerReplica: 1, Commands: o.Commands, Env: o.Env, RepoData: repoData,
			MaxDuration: int(o.MaxDuration / time.Second)},
		JobSubmission: api.JobSubmission{ID: id},
		ClusterInfo:   api.ClusterInfo{JobIPs: []string{""}, GPUsPerJob: max(o.GPUs, 0)},
		Secrets:       map[string]string{},
	}
	wd := o.WorkDir
	if wd == "" {
		wd = "/workflow"
	}
	body.JobSpec.WorkingDir = &wd
	body.JobSpec.RepoDir = &wd
	if o.Detach {
		// Nobody pulls a detached job's output from its runner (attach and
		// logs read what the shim keeps once it is gone): it leaves at the
		// job's end and gives its ports back for the next run.
		body.Tandem = &api.SubmitExtras{NoPull: true}
	}
	return body
}

// prepareJob submits the job and uploads the code.
func prepareJob(ctx context.Context, r *runnerclient.Client, o RunOptions, body api.SubmitBody) error {
	if err := r.Submit(ctx, body); err != nil {
		if o.Network == "host" && errors.Is(err, api.ErrConflict) {
			return withHint(HintBridgeNetwork, fmt.Errorf("submit job: %w: the runner at this port already has a job", err))
		}
		return fmt.Errorf("submit job: %w", err)
	}
	if o.CodeDir != "" {
		pr, pw := io.Pipe()
		go func() { pw.CloseWithError(tarDir(o.CodeDir, pw)) }()
		err := r.UploadCode(ctx, pr)
		pr.Close()
		if err != nil {
			return fmt.Errorf("upload code from %s: %w", o.CodeDir, err)
		}
	}
	return nil
}

// startJob starts the submitted job.
func startJob(ctx context.Context, r *runnerclient.Client, o RunOptions) error {
	rr, _, err := r.Run(ctx)
	if err != nil {
		return fmt.Errorf("start job: %w", err)
	}
	if rr.WorkingDir != "" {
		o.status("job running in %s as %s", rr.WorkingDir, rr.Username)
	}
	return nil
}

// tarDir writes dir as an uncompressed tar with paths relative to it.
func tarDir(dir string, w io.Writer) error {
	tw := tar.NewWriter(w)
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil || rel == "." {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		link := ""
		if fi.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		hdr, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		hdr.Name = filepath.ToSlash(rel)
		if d.IsDir() {
			hdr.Name += "/"
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if fi.Mode().IsRegular() {
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			_, err = io.Copy(tw, f)
			f.Close()
			return err
		}
		return nil
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

// follow streams raw output and waits for the job's end; the first signal
// stops the job, the second returns at once (killed: the caller kills the
// task).
func follow(ctx context.Context, r *runnerclient.Client, stops <-chan struct{}, o RunOptions, res Result) (out Result, killed bool, err error) {
	stopped := false
	var notes io.Writer
	if o.Progress != nil {
		notes = progressWriter{o}
	}
	err = watchJob(ctx, r, time.Time{}, o.Out, notes, stops, &res, func() bool {
		if !stopped {
			stopped = true
			o.status("stopping the job (Ctrl-C again to kill it)")
			_ = r.Stop(ctx)
		}
		return false
	})
	if ctx.Err() != nil {
		o.status("killing the job")
		res.State, res.Interrupted = api.JobTerminated, true
		return res, true, nil
	}
	if err == nil && stopped && res.State == api.JobTerminated {
		res.Interrupted = true
	}
	return res, false, err
}

// watchJob streams the job's raw output from since on to out and pulls its
// states until the final one, which it records in res once every byte of
// output was shown (or 10 s passed). Each stop request calls onStop; true
// ends the watch there.
func watchJob(ctx context.Context, r *runnerclient.Client, since time.Time, out, status io.Writer, stops <-chan struct{}, res *Result, onStop func() bool) error {
	return watchJobStream(ctx, r, since, out, status, stops, res, onStop, nil)
}

// watchJobStream is watchJob that also reports (connected, when not nil)
// whether the log stream opened.
func watchJobStream(ctx context.Context, r *runnerclient.Client, since time.Time, out, status io.Writer, stops <-chan struct{}, res *Result, onStop func() bool, connected *atomic.Bool) error {
	wsDone := make(chan struct{})
	wsCtx, cancelWS := context.WithCancel(ctx)
	defer cancelWS()
	go func() {
		defer close(wsDone)
		streamLogs(wsCtx, r, since, out, status, connected)
	}()
	var ts int64
	for {
		p, err := r.Pull(ctx, ts)
		if err != nil {
			return fmt.Errorf("pull job state: %w", err)
		}
		ts = p.LastUpdated
		if n := len(p.JobStates); n > 0 && p.JobStates[n-1].State.Final() {
			f := p.JobStates[n-1]
			res.State, res.ExitStatus, res.Reason, res.Message = f.State, f.ExitStatus, f.TerminationReason, f.TerminationMessage
			select {
			case <-wsDone: // every byte of output shown
			case <-time.After(10 * time.Second):
			}
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-stops:
			if onStop() {
				return nil
			}
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// streamLogs copies the job's raw output from since on to out until it
// ends or ctx does.
func streamLogs(ctx context.Context, r *runnerclient.Client, since time.Time, out, status io.Writer, connected *atomic.Bool) {
	ls, err := r.Logs(ctx, since)
	if err != nil {
		if status != nil && ctx.Err() == nil {
			fmt.Fprintf(status, "log stream: %v\n", err)
		}
		return
	}
	if connected != nil {
		connected.Store(true)
	}
	defer ls.Close()
	for {
		b, err := ls.Next()
		if err != nil {
			return
		}
		_, _ = out.Write(b)
	}
}

// Describe renders a result in one line for people.
func Describe(r Result) string {
	switch {
	case r.State == api.JobDone:
		return "job done"
	case r.ExitStatus != nil && strings.TrimSpace(r.Message) != "":
		return fmt.Sprintf("job failed: exit status %d: %s", *r.ExitStatus, strings.TrimSpace(r.Message))
	case r.ExitStatus != nil:
		return fmt.Sprintf("job failed: exit status %d", *r.ExitStatus)
	case r.Reason != "":
		msg := strings.TrimSpace(r.Message)
		if msg != "" {
			return fmt.Sprintf("job %s: %s: %s", r.State, r.Reason, msg)
		}
		return fmt.Sprintf("job %s: %s", r.State, r.Reason)
	}
	return "job " + string(r.State)
}
