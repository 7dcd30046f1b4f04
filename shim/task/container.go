package task

// The image, the container and its ports: the kinds of a task (resource.go)
// that Docker holds, and the calls that make them.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/distribution/reference"
	"golang.org/x/sys/unix"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/shim/gpu"
)

// imageResource is the task's image, pulled into Docker's store, where it
// stays for the next task.
type imageResource struct{ e *Engine }

func (imageResource) kind() string { return "image" }

// acquire pulls the image, unless its tag pins it (a digest, or a tag but
// latest): that one is used as is when it is there, and the container's
// create says when it is not (an inspect before it only repeated Docker's
// own check, 1 ms of every start). latest, or no tag, is always pulled, as
// dstack's shim does.
func (r imageResource) acquire(s *starting) *failure {
	if s.ctx.Err() != nil {
		return aborted()
	}
	s.mark("prepare")
	ref, reuse, err := imageRef(s.t.cfg.ImageName)
	if err != nil {
		return failf(api.ReasonCreatingContainerError, "pullImage error: %v", err)
	}
	s.ref, s.reuse = ref, reuse
	if err := r.e.commit(s.t, api.TaskPulling, nil); err != nil {
		return aborted()
	}
	if reuse {
		return nil
	}
	if f := r.e.pull(s); f != nil {
		return f
	}
	s.mark("pull")
	return nil
}

// containerResource is the task's container: created and started by the
// start, re-attached by Reconcile, kept after it stops (its logs), removed
// with the task.
type containerResource struct{ e *Engine }

func (containerResource) kind() string { return "container" }

// acquire creates and starts the container. Create must not be cut off
// halfway by a terminate: we want the id, so that remove can find what
// Docker made.
func (r containerResource) acquire(s *starting) *failure {
	e, t := r.e, s.t
	t.mu.Lock()
	s.gpus = slices.Clone(t.held.GPUs)
	t.mu.Unlock()
	spec := e.containerSpec(t, s.dir, s.gpus)
	if s.ctx.Err() != nil {
		return aborted()
	}
	id, err := e.create(s, spec)
	if s.reuse && errors.Is(err, ErrNoImage) {
		if s.ctx.Err() != nil {
			return aborted()
		}
		if f := e.pull(s); f != nil {
			return f
		}
		s.mark("pull")
		id, err = e.create(s, spec)
	} else if s.reuse && err == nil {
		s.log.Debug("image present, not pulling", "image", s.ref)
	}
	if err != nil {
		return failf(api.ReasonCreatingContainerError, "createContainer error: %v", err)
	}
	if err := s.dirReady(); err != nil {
		return failf(api.ReasonExecutorError, "prepare runner dir error: %v", err)
	}
	if err := e.commit(t, api.TaskCreating, nil); err != nil {
		// Terminated meanwhile: remove finds the created container by name.
		return aborted()
	}
	s.mark("create")
	t.mu.Lock()
	t.held.Container.ID = id
	t.mu.Unlock()
	// The id is written with running, right after the start. Writing it
	// here put an fsync beside Docker's own start and cost 6-16 ms of it
	// (issue 30); a shim that dies during the start, or before running's
	// background write lands, leaves a record without the id: recovery
	// finds the container by its name and re-attaches it if it started
	// (case 2 in recover.go).
	if s.ctx.Err() != nil {
		return aborted()
	}
	s.id, err = e.startContainer(context.WithoutCancel(s.ctx), t, id, spec, s.log)
	if err != nil {
		return failf(api.ReasonCreatingContainerError, "startContainer error: %v", err)
	}
	s.mark("start")
	return nil
}

// reattach takes the container found for t: its id, and its ports as
// Docker publishes them (none in host mode) unless the shim forwards them.
func (r containerResource) reattach(_ context.Context, t *task, c ContainerState, _ *slog.Logger) {
	forwarded := r.e.forwarded(t, c)
	t.mu.Lock()
	defer t.mu.Unlock()
	t.held.Container.ID = c.ID
	if c.Ports != nil && !forwarded {
		t.held.Container.Ports = c.Ports
	}
	if len(t.cfg.Publish) > 0 && c.Running {
		t.held.Container.Published = r.e.jobPorts(c.Published)
	}
}

// jobPorts is bound less the runner's ports: what a task published for
// its job, as Docker bound it.
func (e *Engine) jobPorts(bound []api.PublishedPort) []api.PublishedPort {
	out := []api.PublishedPort{}
	for _, p := range bound {
		if !isRunnerPort(p, e.runnerPorts()) {
			out = append(out, p)
		}
	}
	return out
}

// remove removes it by id and by name (removeOwn), unless the pipeline
// never reached create: then Docker holds nothing of the task, and
// removing it needs no Docker (which may be the very thing missing).
func (r containerResource) remove(ctx context.Context, t *task) error {
	t.mu.Lock()
	none := t.held.Container.None
	t.mu.Unlock()
	if none {
		return nil
	}
	return r.e.removeOwn(ctx, t)
}

// forwardResource is a bridge task's runner ports, forwarded by the shim
// (shim/portfwd). They are opened once the container has an address (here,
// and recovery's re-attach) and closed when the task ends. Without a
// Forwarder its ports are Docker's (none in host mode).
type forwardResource struct{ e *Engine }

func (forwardResource) kind() string { return "forwards" }

// forwarded says whether t's container c has the shim's forwards: a
// bridge task for whose runner ports Docker publishes nothing (the job's
// own, tandem_publish, are Docker's either way).
func (e *Engine) forwarded(t *task, c ContainerState) bool {
	if t.cfg.NetworkMode == "host" || e.cfg.Forwarder == nil {
		return false
	}
	return !slices.ContainsFunc(c.Ports, func(p api.PortMapping) bool { return slices.Contains(e.runnerPorts(), p.Container) })
}

// reattach opens the forwards again, which died with the shim, on the
// ports the server was told.
func (r forwardResource) reattach(ctx context.Context, t *task, c ContainerState, log *slog.Logger) {
	if !r.e.forwarded(t, c) || !c.Running {
		return
	}
	t.mu.Lock()
	recorded := t.held.Container.Ports
	t.mu.Unlock()
	ports, err := r.e.forward(ctx, t, c.ID, recorded)
	if err != nil {
		log.Error("re-open the task's forwarded ports", "err", err, "ports", recorded)
		return
	}
	t.mu.Lock()
	t.held.Container.Ports = ports
	t.mu.Unlock()
}

// acquire learns the ports the server is told: forwarded here, or Docker's.
// One inspect says Docker's bindings: the runner's ports where the shim
// forwards none, and the job's published ones (never on the host network:
// validatePublish refuses them there).
func (r forwardResource) acquire(s *starting) *failure {
	e, ctx := r.e, context.WithoutCancel(s.ctx)
	s.ports = []api.PortMapping{}
	switch {
	case s.t.cfg.NetworkMode == "host":
		return nil
	case e.cfg.Forwarder != nil:
		ports, err := e.forward(ctx, s.t, s.id, nil)
		if err != nil {
			if f := e.endedEarly(s.t, s.id, s.log); f != nil {
				return f
			}
			_ = e.rt.Stop(ctx, s.id, 0)
			return failf(api.ReasonCreatingContainerError, "forward the runner's ports: %v", err)
		}
		s.ports = ports
		s.mark("forward")
		if len(s.t.cfg.Publish) == 0 {
			return nil
		}
	}
	st, err := e.rt.Inspect(ctx, s.id)
	if err != nil {
		s.log.Error("discover ports", "err", err)
	}
	if e.cfg.Forwarder == nil && st.Ports != nil {
		s.ports = st.Ports
	}
	if len(s.t.cfg.Publish) > 0 {
		s.published = e.jobPorts(st.Published)
	}
	return nil
}

func (r forwardResource) release(t *task, _ *slog.Logger) error {
	if r.e.cfg.Forwarder != nil {
		r.e.cfg.Forwarder.Close(t.cfg.ID)
	}
	return nil
}

// pull pulls s's image; dirReady's failure wins over the pull's (the
// pull's log is in the runner dir).
func (e *Engine) pull(s *starting) *failure {
	err := e.pullImage(s.ctx, s.t, s.ref, s.dir, s.dirReady, s.log)
	if err == nil {
		return nil
	}
	if s.ctx.Err() != nil {
		return aborted()
	}
	if derr := s.dirReady(); derr != nil {
		return failf(api.ReasonExecutorError, "prepare runner dir error: %v", derr)
	}
	return failf(api.ReasonCreatingContainerError, "pullImage error: %v", err)
}

// create creates s's container. From each create call on a container may
// exist, and remove looks for it by name, unless the create surely made
// nothing.
func (e *Engine) create(s *starting, spec ContainerSpec) (string, error) {
	t := s.t
	t.mu.Lock()
	t.held.Container.None = false
	t.mu.Unlock()
	id, err := e.rt.Create(context.WithoutCancel(s.ctx), spec)
	if errors.Is(err, ErrNothingCreated) {
		t.mu.Lock()
		t.held.Container.None = true
		t.mu.Unlock()
	}
	return id, err
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
	t.held.Container.ID = id
	t.mu.Unlock()
	e.mustSave(t)
	return id, e.rt.Start(ctx, id)
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
	// A submit's answer waits no longer: a registry's time is not ours to
	// hold a request for (AwaitSettled).
	t.markSettled()
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
