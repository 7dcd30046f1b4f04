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
	// Interrupt delivers Ctrl-C presses (and SIGTERM). Before the job runs
	// the first one cancels the run; while it runs the first stops the job
	// gracefully and the second tears the task down at once. Either way the
	// task is terminated and removed.
	Interrupt <-chan os.Signal
	// Started, when set, is called once the job runs (e.g. to write the
	// task's SSH config entry).
	Started func(info api.TaskInfoResponse)
	Out     io.Writer // job output
	// Workers receives the other nodes' job output in a multi-node run
	// (nil: stderr).
	Workers io.Writer
	// Progress receives the run's steps (progress.go); nil: none are shown.
	Progress func(Event)
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

// ErrInterrupted means the user's signal cancelled the run before the job
// started.
var ErrInterrupted = errors.New("interrupted")

// Run drives one run to its end and removes the task (unless detached).
func Run(ctx context.Context, o RunOptions) (Result, error) {
	if len(o.Commands) == 0 {
		return Result{}, errors.New("no command given: tandem run [flags] -- COMMAND")
	}
	if o.Network == "" {
		o.Network = "host"
	}
	shim, err := newShimClient(o.Shim, o.Dial, o.ShimToken)
	if err != nil {
		return Result{}, err
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	sigs := routeSignals(o.Interrupt, cancel)
	defer sigs.close()
	hc, err := helloShim(ctx, shim, o.Shim)
	if err != nil {
		return Result{Interrupted: interrupted(ctx)}, err
	}
	o.status("shim %s (%s)", o.Shim, hc.Version)
	id := newID()
	name := o.Name
	if name == "" {
		name = "tandem-" + id[:8]
	}
	res := Result{TaskID: id, Name: name}
	cfg := taskConfig(o, id, name)
	// A submit repeated with the same config is a no-op on the shim, so
	// one lost to a slow or restarting shim is made again.
	if _, err := retry(ctx, waitPatience, func(ctx context.Context) (struct{}, error) { return struct{}{}, shim.SubmitTask(ctx, cfg) }); err != nil {
		res.Interrupted = interrupted(ctx)
		return res, fmt.Errorf("the shim rejected the task: %w", err)
	}
	// Whatever happens from here on, take the task down, unless detached.
	// A user's interrupt before the job ran, or a second one, kills at once.
	killNow := false
	defer func() {
		if res.Detached {
			return
		}
		timeout := uint(5)
		if killNow || res.Interrupted {
			timeout = 0
		}
		if err := cleanup(context.WithoutCancel(ctx), shim, id, timeout); err != nil {
			o.statusAlways("tandem: task %s was left on the shim: %v\nremove it with: tandem rm -f --shim %s %s", ShortID(id), err, o.Shim, name)
		}
	}()
	fail := func(err error) (Result, error) {
		if interrupted(ctx) {
			res.Interrupted, res.State = true, api.JobTerminated
			o.status("interrupted: removing task %s", ShortID(id))
			return res, ErrInterrupted
		}
		return res, err
	}
	info, err := waitTask(ctx, shim, id, o)
	if err != nil {
		return fail(err)
	}
	if info.Status == api.TaskTerminated {
		res.State, res.Reason, res.Message = api.JobFailed, info.TerminationReason, info.TerminationMessage
		return res, taskEnded(info, o.Network)
	}
	runner, err := readyRunner(ctx, o.Shim, info, o.RunnerPort, o.Dial)
	if err != nil {
		if interrupted(ctx) {
			return fail(err)
		}
		return res, err
	}
	if err := submitJob(ctx, runner, o, id, name); err != nil {
		return fail(err)
	}
	sigs.running.Store(true)
	if interrupted(ctx) { // a signal between the job's start and the switch
		return fail(ErrInterrupted)
	}
	if o.Started != nil {
		o.Started(info)
	}
	if o.Detach {
		res.Detached, res.State = true, api.JobRunning
		return res, nil
	}
	res, killNow, err = follow(ctx, runner, sigs.job, o, res)
	if err != nil {
		// The runner is gone: the shim knows why.
		info, gerr := retry(ctx, 30*time.Second, func(ctx context.Context) (api.TaskInfoResponse, error) { return shim.GetTask(ctx, id) })
		switch {
		case errors.Is(gerr, api.ErrNotFound):
			res.State = api.JobTerminated
			return res, fmt.Errorf("task %s was terminated and removed by someone else (tandem stop or the server)", ShortID(id))
		case gerr == nil && info.Status == api.TaskTerminated:
			res.State, res.Reason, res.Message = api.JobTerminated, info.TerminationReason, info.TerminationMessage
			return res, fmt.Errorf("task %s was terminated: %s %s", ShortID(id), api.Printable(string(info.TerminationReason)), api.Printable(strings.TrimSpace(info.TerminationMessage)))
		}
	}
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
		ShmSize: o.ShmSize, NetworkMode: o.Network, InstanceMounts: o.Mounts, ContainerSSHKeys: o.SSHKeys}
}

// taskEnded says why a task ended before its job started: the shim's
// reason and the container's last lines (escaped per line), with a hint
// for the host-network port clash.
func taskEnded(info api.TaskInfoResponse, network string) error {
	hint := ""
	if network != "bridge" && strings.Contains(info.TerminationMessage, "address already in use") {
		hint = "\nanother host-network task on this shim holds the runner's ports (tandem ps); use --network bridge, or stop that task"
	}
	var lines []string
	for _, l := range strings.Split(strings.TrimSpace(info.TerminationMessage), "\n") {
		lines = append(lines, api.Printable(l))
	}
	return fmt.Errorf("task ended before the job started: %s: %s%s", api.Printable(string(info.TerminationReason)), strings.Join(lines, "\n"), hint)
}

// readyRunner is a client of the task's runner once it answers.
func readyRunner(ctx context.Context, shimAddr string, info api.TaskInfoResponse, port int, dial func(context.Context, string, string) (net.Conn, error)) (*runnerclient.Client, error) {
	r, addr, err := runnerFor(shimAddr, info, port, dial)
	if err != nil {
		return nil, err
	}
	if err := waitRunner(ctx, r); err != nil {
		return nil, fmt.Errorf("runner at %s did not answer: %w (if the shim runs it elsewhere, give --runner-port)", addr, err)
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

// signalRouter sends the user's signals where they belong: before the job
// runs the first one cancels everything; once it runs they go to job (stop,
// then kill).
type signalRouter struct {
	running atomic.Bool
	job     chan os.Signal
	done    chan struct{}
}

func routeSignals(in <-chan os.Signal, cancel context.CancelCauseFunc) *signalRouter {
	s := &signalRouter{job: make(chan os.Signal, 4), done: make(chan struct{})}
	go func() {
		for {
			select {
			case <-s.done:
				return
			case sig, ok := <-in:
				if !ok {
					return
				}
				if !s.running.Load() {
					cancel(ErrInterrupted)
					continue
				}
				select {
				case s.job <- sig:
				case <-s.done:
					return
				}
			}
		}
	}()
	return s
}

func (s *signalRouter) close() { close(s.done) }

func interrupted(ctx context.Context) bool { return errors.Is(context.Cause(ctx), ErrInterrupted) }

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

func waitRunner(ctx context.Context, r *runnerclient.Client) error {
	deadline := time.Now().Add(60 * time.Second)
	for {
		_, err := r.Healthcheck(ctx)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
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
	return body
}

// prepareJob submits the job and uploads the code.
func prepareJob(ctx context.Context, r *runnerclient.Client, o RunOptions, body api.SubmitBody) error {
	if err := r.Submit(ctx, body); err != nil {
		if o.Network == "host" && errors.Is(err, api.ErrConflict) {
			return fmt.Errorf("submit job: %w: the runner at this port already has a job: another host-network task on this shim holds the runner's ports (tandem ps); use --network bridge, or stop that task", err)
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
func follow(ctx context.Context, r *runnerclient.Client, sigs <-chan os.Signal, o RunOptions, res Result) (out Result, killed bool, err error) {
	interrupts := 0
	var notes io.Writer
	if o.Progress != nil {
		notes = progressWriter{o}
	}
	err = watchJob(ctx, r, time.Time{}, o.Out, notes, sigs, &res, func() bool {
		interrupts++
		if interrupts == 1 {
			o.status("stopping the job (Ctrl-C again to kill it)")
			_ = r.Stop(ctx)
			return false
		}
		o.status("killing the job")
		res.State, res.Interrupted, killed = api.JobTerminated, true, true
		return true
	})
	if err == nil && interrupts > 0 && res.State == api.JobTerminated {
		res.Interrupted = true
	}
	return res, killed, err
}

// watchJob streams the job's raw output from since on to out and pulls its
// states until the final one, which it records in res once every byte of
// output was shown (or 10 s passed). Each signal calls onSignal; true ends
// the watch there.
func watchJob(ctx context.Context, r *runnerclient.Client, since time.Time, out, status io.Writer, sigs <-chan os.Signal, res *Result, onSignal func() bool) error {
	wsDone := make(chan struct{})
	wsCtx, cancelWS := context.WithCancel(ctx)
	defer cancelWS()
	go func() {
		defer close(wsDone)
		streamLogs(wsCtx, r, since, out, status)
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
		case <-sigs:
			if onSignal() {
				return nil
			}
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// streamLogs copies the job's raw output from since on to out until it
// ends or ctx does.
func streamLogs(ctx context.Context, r *runnerclient.Client, since time.Time, out, status io.Writer) {
	ls, err := r.Logs(ctx, since)
	if err != nil {
		if status != nil && ctx.Err() == nil {
			fmt.Fprintf(status, "log stream: %v\n", err)
		}
		return
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
