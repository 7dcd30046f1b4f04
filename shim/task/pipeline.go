package task

// The start pipeline: prepare, pull, create, start, watch, end and release.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/distribution/reference"
	"golang.org/x/sys/unix"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/shim/gpu"
)

// runnerDir is <home>/runners/<container name>; a name that is not one path
// component (a damaged record) has no dir, never a parent's.
func (e *Engine) runnerDir(t *task) (string, error) {
	if t.name == "" || t.name != filepath.Base(t.name) || t.name == "." || t.name == ".." {
		return "", fmt.Errorf("task %s has no valid container name (%q)", t.cfg.ID, t.name)
	}
	return filepath.Join(e.cfg.Home, "runners", t.name), nil
}

// roomReserver is what RunnerDirs may also be: they take a new task's room
// on the disk before it is accepted (an error: refused, nothing written).
type roomReserver interface {
	Reserve(dir string) (release func(), err error)
}

// reserveRunnerDir takes the room of t's runner dir, when its RunnerDirs
// take room; release gives it back, harmless once the dir is made.
func (e *Engine) reserveRunnerDir(t *task) (release func(), err error) {
	r, ok := e.cfg.RunnerDirs.(roomReserver)
	if !ok {
		return func() {}, nil
	}
	dir, err := e.runnerDir(t)
	if err != nil {
		return func() {}, nil // the start fails on it, and says why
	}
	return r.Reserve(dir)
}

// failure is how a pipeline stage ends a task.
type failure struct {
	reason api.TerminationReason
	msg    string
}

// run is the start pipeline of one task; it returns when the task ended and
// its host resources are released.
func (e *Engine) run(ctx context.Context, t *task) {
	log := e.log.With("task_id", t.cfg.ID, "container", t.name)
	defer t.cancelPre()
	if f := e.start(ctx, t, log); f != nil {
		e.end(t, log, *f)
		return
	}
	e.watch(t, log)
}

// end releases the task's host resources, then commits terminated as its
// last change: a terminated task holds nothing, but what a failed release
// kept, which its record names (holds) and which is retried.
func (e *Engine) end(t *task, log *slog.Logger, f failure) {
	e.release(t, log)
	_ = e.transition(t, change{to: api.TaskTerminated, reason: f.reason, msg: f.msg, persist: persistSoon, last: true})
	t.mu.Lock()
	reason := t.reason // a stop request's reason wins over f's
	t.mu.Unlock()
	e.obs().TaskEnded(reason)
	level := slog.LevelInfo
	switch reason {
	case api.ReasonExecutorError, api.ReasonCreatingContainerError, api.ReasonContainerExitedWithError:
		level = slog.LevelWarn
	}
	log.Log(context.Background(), level, "task terminated", "reason", reason, "message", f.msg)
}

// reclaim re-takes, after a restart, what t's record (or container) says
// it holds, in acquire order, without touching the host. Harmless twice.
func (e *Engine) reclaim(t *task, log *slog.Logger) {
	for _, r := range e.resources {
		r.reclaim(t, log)
	}
}

// watch waits for the running container to exit, whoever stops it, and
// ends the task with the matching reason.
func (e *Engine) watch(t *task, log *slog.Logger) {
	t.mu.Lock()
	id := t.contID
	t.mu.Unlock()
	code, err := e.waitExit(e.life, id, log)
	if e.life.Err() == nil {
		e.learnJob(t) // before anything else: the job's own word on its end
	}
	if e.life.Err() != nil {
		// The shim is shutting down: the task keeps running, and the next
		// start re-attaches to it. Nothing to end, but nothing more runs
		// for it here either.
		t.markDone()
		return
	}
	e.end(t, log, e.exitEnd(id, code, err, log))
}

// exitEnd is how a task whose container stopped ends: done with exit code
// 0, else with the container's last lines (or its code) as the message.
// err is the wait's failure, if any.
func (e *Engine) exitEnd(id string, code int, err error, log *slog.Logger) failure {
	switch {
	case errors.Is(err, ErrContainerGone):
		return failure{api.ReasonContainerExitedWithError, "the container disappeared"}
	case err != nil:
		return failure{api.ReasonContainerExitedWithError, err.Error()}
	case code == 0:
		return failure{api.ReasonDoneByRunner, ""}
	}
	lctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	tailText, lerr := e.rt.LogTail(lctx, id, 5)
	cancel()
	if lerr != nil {
		log.Warn("read container log tail", "err", lerr)
	}
	if tailText == "" {
		tailText = fmt.Sprintf("container exited with code %d", code)
	}
	return failure{api.ReasonContainerExitedWithError, tailText}
}

// waitExit waits for a container to stop, until ctx ends. A wait cut by a
// Docker restart is resumed (the task stays running meanwhile); only a
// container that is really gone or stopped ends it.
func (e *Engine) waitExit(ctx context.Context, id string, log *slog.Logger) (int, error) {
	backoff := 500 * time.Millisecond
	for {
		code, err := e.rt.Wait(ctx, id)
		if err == nil {
			return code, nil
		}
		if ctx.Err() != nil {
			return -1, ctx.Err()
		}
		ictx, cancel := context.WithTimeout(ctx, dockerCallTimeout)
		st, ierr := e.rt.Inspect(ictx, id)
		cancel()
		switch {
		case errors.Is(ierr, ErrContainerGone):
			return -1, ErrContainerGone
		case ierr == nil && !st.Running:
			return st.ExitCode, nil
		}
		log.Warn("lost the wait on the container; retrying", "err", err, "retry_in", backoff)
		select {
		case <-ctx.Done():
			return -1, ctx.Err()
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, 10*time.Second)
	}
}

// start runs the stages up to a running container. A nil result means the
// container runs; what the task holds is given back by release when it
// ends.
func (e *Engine) start(ctx context.Context, t *task, log *slog.Logger) *failure {
	fail := func(reason api.TerminationReason, format string, args ...any) *failure {
		return &failure{reason, fmt.Sprintf(format, args...)}
	}
	aborted := func() *failure {
		return fail(api.ReasonTerminatedByServer, "terminated before start")
	}
	cfg := t.cfg
	began := e.now()
	// The timing line: the record write, then each stage since the last
	// (prepare, pull: the image check when it is local, create, start,
	// commit: ports and the running status, its record queued for the
	// background writer), then submit to running.
	phases := []any{"record", t.recordTook.Round(100 * time.Microsecond)}
	mark := func(name string) {
		now := e.now()
		phases = append(phases, name, now.Sub(began).Round(100*time.Microsecond))
		began = now
	}
	if err := e.commit(t, api.TaskPreparing, nil); err != nil {
		return aborted()
	}
	dir, err := e.runnerDir(t)
	if err == nil {
		// The bind's source exists from here on: Docker checks it at
		// create, and binds what is mounted there at start.
		err = os.MkdirAll(dir, 0o755)
	}
	if err == nil {
		err = os.MkdirAll(e.hostFSProbe(), 0o555)
	}
	if err != nil {
		return fail(api.ReasonExecutorError, "prepare runner dir error: %v", err)
	}
	// The dir's own filesystem is made and mounted while the image is
	// checked and the container created (2-3 ms off every start). Nothing
	// is written into the dir before it is ready (a pull's log waits), the
	// container starts only then, and start does not return before it is
	// done, so release never races a mount.
	if h, ok := e.cfg.RunnerDirs.(startHolder); ok {
		// The next ready copy waits until this start is over.
		defer h.Hold()()
	}
	dirReady := e.makeRunnerDir(ctx, dir)
	defer func() { _ = dirReady() }()

	// Host resources, in order (resource.go); release undoes them.
	for _, r := range e.resources {
		if f := r.acquire(ctx, t); f != nil {
			return f
		}
	}
	if ctx.Err() != nil {
		return aborted()
	}

	mark("prepare")
	ref, reuse, err := imageRef(cfg.ImageName)
	if err != nil {
		return fail(api.ReasonCreatingContainerError, "pullImage error: %v", err)
	}
	if err := e.commit(t, api.TaskPulling, nil); err != nil {
		return aborted()
	}
	pull := func() *failure {
		err := e.pullImage(ctx, t, ref, dir, dirReady, log)
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return aborted()
		}
		if derr := dirReady(); derr != nil {
			return fail(api.ReasonExecutorError, "prepare runner dir error: %v", derr)
		}
		return fail(api.ReasonCreatingContainerError, "pullImage error: %v", err)
	}
	if !reuse { // latest, or no tag: always pulled, as dstack's shim does
		if f := pull(); f != nil {
			return f
		}
		mark("pull")
	}
	t.mu.Lock()
	gpuIDs := slices.Clone(t.gpuIDs)
	t.mu.Unlock()
	spec := e.containerSpec(t, dir, gpuIDs)
	// Create must not be cut off halfway by a terminate: we want the id, so
	// that remove can find what Docker made. A local image is used as is:
	// create goes first and says when the image is not there (an inspect
	// before it only repeated Docker's own check, 1 ms of every start),
	// then it is pulled and create runs again.
	if ctx.Err() != nil {
		return aborted()
	}
	// From each create call on a container may exist, and remove looks for
	// it by name, unless the create surely made nothing.
	create := func() (string, error) {
		t.mu.Lock()
		t.noContainer = false
		t.mu.Unlock()
		id, err := e.rt.Create(context.WithoutCancel(ctx), spec)
		if errors.Is(err, ErrNothingCreated) {
			t.mu.Lock()
			t.noContainer = true
			t.mu.Unlock()
		}
		return id, err
	}
	id, err := create()
	if reuse && errors.Is(err, ErrNoImage) {
		if ctx.Err() != nil {
			return aborted()
		}
		if f := pull(); f != nil {
			return f
		}
		mark("pull")
		id, err = create()
	} else if reuse && err == nil {
		log.Debug("image present, not pulling", "image", ref)
	}
	if err != nil {
		return fail(api.ReasonCreatingContainerError, "createContainer error: %v", err)
	}
	if err := dirReady(); err != nil {
		return fail(api.ReasonExecutorError, "prepare runner dir error: %v", err)
	}
	if err := e.commit(t, api.TaskCreating, nil); err != nil {
		// Terminated meanwhile: remove finds the created container by name.
		return aborted()
	}
	mark("create")
	t.mu.Lock()
	t.contID = id
	t.mu.Unlock()
	// The id is written with running, right after the start. Writing it
	// here put an fsync beside Docker's own start and cost 6-16 ms of it
	// (issue 30); a shim that dies during the start, or before running's
	// background write lands, leaves a record without the id: recovery
	// finds the container by its name and re-attaches it if it started
	// (case 2 in recover.go).
	if ctx.Err() != nil {
		return aborted()
	}
	id, err = e.startContainer(context.WithoutCancel(ctx), t, id, spec, log)
	if err != nil {
		return fail(api.ReasonCreatingContainerError, "startContainer error: %v", err)
	}
	mark("start")
	ports := []api.PortMapping{}
	switch {
	case cfg.NetworkMode == "host":
	case e.cfg.Forwarder != nil:
		if ports, err = e.forward(context.WithoutCancel(ctx), t, id, nil); err != nil {
			if f := e.endedEarly(t, id, log); f != nil {
				return f
			}
			_ = e.rt.Stop(context.WithoutCancel(ctx), id, 0)
			return fail(api.ReasonCreatingContainerError, "forward the runner's ports: %v", err)
		}
		mark("forward")
	default:
		ports, err = e.rt.Ports(context.WithoutCancel(ctx), id)
		if err != nil {
			log.Error("discover ports", "err", err)
			ports = []api.PortMapping{}
		}
	}
	if err := e.commit(t, api.TaskRunning, func() { t.ports, t.watched = ports, true }); err != nil {
		// Terminated while we were starting it: do not leave it running.
		_ = e.rt.Stop(context.WithoutCancel(ctx), id, 0)
		return aborted()
	}
	mark("commit")
	if !t.submitted.IsZero() {
		phases = append(phases, "total", e.now().Sub(t.submitted).Round(100*time.Microsecond))
	}
	log.Info("task running", append([]any{"container_id", id, "ports", ports, "gpus", gpuIDs}, phases...)...)
	if !t.submitted.IsZero() {
		e.obs().TaskRunning(e.now().Sub(t.submitted))
	}
	return nil
}

// endedEarly is how a task ends whose container stopped before the shim
// could forward its ports (its address goes with it): as any container
// that stopped, done or failed with its own last lines, not as a start
// that failed. nil: the container still runs (or cannot be asked), so the
// forward's own failure stands.
func (e *Engine) endedEarly(t *task, id string, log *slog.Logger) *failure {
	ictx, cancel := context.WithTimeout(context.Background(), dockerCallTimeout)
	st, err := e.rt.Inspect(ictx, id)
	cancel()
	switch {
	case errors.Is(err, ErrContainerGone): // exitEnd words it
	case err != nil || st.Running:
		return nil
	default:
		e.learnJob(t) // the job's own word on its end, as watch takes it
	}
	f := e.exitEnd(id, st.ExitCode, err, log)
	log.Debug("the container stopped before its ports were forwarded", "exit_code", st.ExitCode, "err", err)
	return &f
}

// startContainer starts the created container id. A host without
// /dev/nvidia-modeset refuses a container asking for the display
// capability: it is made again without it, once, and that one's id is
// returned.
func (e *Engine) startContainer(ctx context.Context, t *task, id string, spec ContainerSpec, log *slog.Logger) (string, error) {
	err := e.rt.Start(ctx, id)
	if !errors.Is(err, ErrNoModeset) || !gpu.HasDisplay(spec.GPUs) {
		return id, err
	}
	log.Warn("no /dev/nvidia-modeset on this host; starting without the display capability", "err", err)
	_ = e.rt.Remove(ctx, id)
	id, err = e.rt.Create(ctx, withoutDisplay(spec))
	if err != nil {
		return "", err
	}
	t.mu.Lock()
	t.contID = id
	t.mu.Unlock()
	e.mustSave(t)
	return id, e.rt.Start(ctx, id)
}

func (e *Engine) prepareInstanceMounts(mounts []api.InstanceMountPoint) error {
	for _, m := range mounts {
		if !filepath.IsAbs(m.InstancePath) || !filepath.IsAbs(m.Path) {
			return fmt.Errorf("instance mount %q -> %q: paths must be absolute", m.InstancePath, m.Path)
		}
		clean := filepath.Clean(m.InstancePath)
		home := filepath.Clean(e.cfg.Home)
		if clean == home || strings.HasPrefix(clean, home+string(filepath.Separator)) {
			return fmt.Errorf("instance mount %q: paths under the shim home are not allowed", m.InstancePath)
		}
		if _, err := os.Stat(clean); os.IsNotExist(err) {
			if m.MustExist {
				return missingMountError(m)
			}
			// dstack's server expects a missing path made (an instance
			// volume's first use): 0755, as docker -v makes one, never the
			// 0777 that let every user of the host write there.
			if err := os.MkdirAll(clean, 0o755); err != nil {
				return fmt.Errorf("create %s: %w", clean, err)
			}
		} else if err != nil {
			return fmt.Errorf("stat %s: %w", clean, err)
		}
	}
	return nil
}

// checkMountSources refuses, at submit and before anything is made, an
// instance mount whose client asked for an existing host path
// (MustExist) that is not there.
func checkMountSources(mounts []api.InstanceMountPoint) error {
	for _, m := range mounts {
		if !m.MustExist || !filepath.IsAbs(m.InstancePath) {
			continue
		}
		if _, err := os.Stat(filepath.Clean(m.InstancePath)); os.IsNotExist(err) {
			return fmt.Errorf("%w: %v", ErrInvalid, missingMountError(m))
		}
	}
	return nil
}

func missingMountError(m api.InstanceMountPoint) error {
	return fmt.Errorf("instance mount %s: no such file or directory on the host (it is not created: make it first)", strconv.Quote(filepath.Clean(m.InstancePath)))
}

// imageRef normalizes ref and says whether a local copy may be used as is:
// a tag other than latest, or a digest.
func imageRef(ref string) (string, bool, error) {
	named, err := reference.ParseNormalizedNamed(ref)
	if err != nil {
		return "", false, fmt.Errorf("image %q: %w", ref, err)
	}
	named = reference.TagNameOnly(named)
	if _, ok := named.(reference.Digested); ok {
		return reference.FamiliarString(named), true, nil
	}
	tagged, _ := named.(reference.Tagged)
	return reference.FamiliarString(named), tagged != nil && tagged.Tag() != "latest", nil
}

// makeRunnerDir makes dir's filesystem in the background; the returned
// func waits for it and gives its error, the same each call.
func (e *Engine) makeRunnerDir(ctx context.Context, dir string) func() error {
	made := make(chan struct{})
	var err error
	go func() {
		defer close(made)
		err = e.cfg.RunnerDirs.Make(ctx, dir)
	}()
	return func() error {
		<-made
		return err
	}
}

// pullImage pulls ref (normalized by imageRef) and checks that it landed
// in the local store. dirReady waits for the runner dir, where the pull
// writes its log.
func (e *Engine) pullImage(ctx context.Context, t *task, ref, dir string, dirReady func() error, log *slog.Logger) (err error) {
	var auth RegistryAuth
	if t.cfg.RegistryUsername != "" || t.cfg.RegistryPassword != "" {
		auth = RegistryAuth{Username: t.cfg.RegistryUsername, Password: t.cfg.RegistryPassword}
		if named, err := reference.ParseNormalizedNamed(ref); err == nil {
			auth.ServerAddress = reference.Domain(named)
		}
	}
	pctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	if e.cfg.PullTimeout > 0 {
		var c2 context.CancelFunc
		pctx, c2 = context.WithTimeoutCause(pctx, e.cfg.PullTimeout, fmt.Errorf("pull exceeded %s", e.cfg.PullTimeout))
		defer c2()
	}
	tracker := t.tracker
	// Stall watchdog: no byte moved for PullStallTimeout → give up.
	go func() {
		tick := time.NewTicker(min(e.cfg.PullStallTimeout/4, 5*time.Second))
		defer tick.Stop()
		for {
			select {
			case <-pctx.Done():
				return
			case <-tick.C:
				if d := tracker.SinceProgress(); d >= e.cfg.PullStallTimeout {
					cancel(fmt.Errorf("no progress for %s", d.Round(time.Second)))
					return
				}
			}
		}
	}()
	if err := dirReady(); err != nil {
		return fmt.Errorf("prepare runner dir: %w", err)
	}
	// The runner dir is the job's too: never write through a link there.
	logFile, err := os.OpenFile(filepath.Join(dir, "pull.log"), os.O_CREATE|os.O_WRONLY|os.O_TRUNC|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o644)
	if err != nil {
		return fmt.Errorf("pull log: %w", err)
	}
	// A pull really starts here (an image used as is is none): count it.
	began := e.now()
	defer func() {
		var n int64
		if p := t.tracker.Progress(); p != nil {
			n = p.DownloadedBytes
		}
		e.obs().ImagePulled(n, e.now().Sub(began), err)
		if err != nil {
			log.Warn("image pull failed", "image", t.cfg.ImageName, "err", err)
		}
	}()
	defer logFile.Close()
	rc, err := e.rt.Pull(pctx, ref, auth)
	if err != nil {
		if cause := context.Cause(pctx); cause != nil {
			return fmt.Errorf("image pull interrupted: %s: %w", tracker.Summary(), cause)
		}
		return err
	}
	ferr := tracker.Feed(rc, logFile)
	rc.Close()
	if cause := context.Cause(pctx); cause != nil {
		return fmt.Errorf("image pull interrupted: %s: %w", tracker.Summary(), cause)
	}
	if ferr != nil {
		return fmt.Errorf("failed pulling %s: %s, errors: [%v]", ref, tracker.Summary(), ferr)
	}
	// Success is the image being there, not a particular status line (#2503).
	present, err := e.rt.ImagePresent(ctx, ref)
	if err != nil {
		return err
	}
	if !present {
		return fmt.Errorf("failed pulling %s: the pull ended but the image is not in the local store", ref)
	}
	return nil
}

// forward publishes a bridge task's runner ports through the engine's
// Forwarder, on the host ports in want where given (a restart keeps what
// the server was told).
func (e *Engine) forward(ctx context.Context, t *task, contID string, want []api.PortMapping) ([]api.PortMapping, error) {
	t.mu.Lock()
	network := t.network
	t.mu.Unlock()
	ip, err := e.rt.Address(ctx, contID, network)
	if err != nil {
		return nil, err
	}
	return e.cfg.Forwarder.Open(t.cfg.ID, ip, e.runnerPorts(), want)
}
