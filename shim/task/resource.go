package task

// A task is the ordered list of what it holds (newResources): its runner
// dir, GPUs, host keys, volumes, instance mounts, network, image,
// container and forwards. Each kind is one type with only the phases it
// has, each an optional interface: acquire (a start walks the list in
// order), release (when the task ends, in reverse; what fails is kept in
// the record's holds and retried), remove (when Remove forgets it, in
// reverse), and after a restart restore (every record read back), reclaim
// (a running task, before Docker answers) and reattach (once it has). What
// a kind keeps across a restart is its part of the record (held). Adding a
// kind is one type here and one line in newResources.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"

	"github.com/tandem-run/tandem/api"
)

// resource is one kind of what a task holds. Each has only the phases it
// has, as the optional interfaces below; the engine walks the list for
// each phase, skipping the kinds without it.
type resource interface {
	// kind names it in logs and in the record's holds.
	kind() string
}

// acquirer takes what t's config asks for. What it holds is written into
// t (under t.mu), and persisted before any host side effect that outlives
// the shim, so a crash leaves a release that finds nothing rather than a
// change nobody undoes.
type acquirer interface {
	acquire(s *starting) *failure
}

// releaser gives back what t holds when it ends. It is a no-op for a
// resource never acquired, and harmless twice: a failed one is retried
// (Engine.release) and kept in the record's holds.
type releaser interface {
	release(t *task, log *slog.Logger) error
}

// reclaimer re-takes, after a restart, what a running task's record (or
// container) says it holds, without touching the host.
type reclaimer interface {
	reclaim(t *task, log *slog.Logger)
}

// reattacher takes up, once Docker answered after a restart, what a
// running task's container has: its id, its ports, their forwards.
type reattacher interface {
	reattach(ctx context.Context, t *task, c ContainerState, log *slog.Logger)
}

// remover removes what outlives a task's end, when Remove forgets it; in
// reverse order, after what it held is released. Harmless twice: a
// failed one fails the Remove, which may be asked again.
type remover interface {
	remove(ctx context.Context, t *task) error
}

// restorer makes what a task holds usable again after a restart, for
// every task read back from a record, ended or not.
type restorer interface {
	restore(t *task, log *slog.Logger)
}

// held is what a task holds as its record keeps it: one part per kind of
// its list that has state to keep (the others derive theirs: the runner
// dir from the container's name, the network from the config, forwards
// from the container's ports).
type held struct {
	Container heldContainer `json:"container"`
	GPUs      []string      `json:"gpus"`                // locked for it (gpuResource)
	HostKeys  bool          `json:"host_keys,omitempty"` // its lines are in authorized_keys (hostKeysResource)
	Volumes   []string      `json:"volumes,omitempty"`   // may be mounted for it (volumesResource)
}

// heldContainer is the container's part of the record.
type heldContainer struct {
	Name  string            `json:"name"`
	ID    string            `json:"id"`
	Ports []api.PortMapping `json:"ports"` // as the server was told
	// None: the task ended before create; trusted only together with a
	// terminated status (restored).
	None bool `json:"none,omitempty"`
}

// heldOf is what t holds, for its record; t.mu held.
func heldOf(t *task) held {
	return held{
		Container: heldContainer{Name: t.name, ID: t.contID, Ports: slices.Clone(t.ports), None: t.noContainer},
		GPUs:      slices.Clone(t.gpuIDs), HostKeys: t.keysAdded, Volumes: slices.Clone(t.volumes),
	}
}

// setHeld gives a task read back from its record (status set) what the
// record says it holds.
func (t *task) setHeld(h held, status api.TaskStatus) {
	t.name, t.contID, t.ports = h.Container.Name, h.Container.ID, h.Container.Ports
	t.gpuIDs, t.keysAdded, t.volumes = h.GPUs, h.HostKeys, h.Volumes
	// A record written before the task ended may predate its create: only
	// a terminated one is sure that Docker never got a container.
	t.noContainer = h.Container.None && status == api.TaskTerminated
}

// newResources is the acquire order; release and remove walk it backwards.
func newResources(e *Engine) []resource {
	return []resource{runnerDirResource{e}, gpuResource{e}, hostKeysResource{e}, volumesResource{e}, instanceMountsResource{e},
		networkResource{e}, imageResource{e}, containerResource{e}, forwardResource{e}}
}

// runnerDirResource is the task's runner dir, <home>/runners/<container
// name>: made by the start (pipeline.go), kept after the task ends (the
// job's final state and log are read from it), re-attached after a
// restart, removed with the task.
type runnerDirResource struct{ e *Engine }

func (runnerDirResource) kind() string { return "runner_dir" }

// acquire makes the dir; its own filesystem is made and mounted in the
// background while the image is checked and the container created (2-3
// ms off every start). Nothing is written into the dir before it is ready
// (a pull's log waits), the container starts only then, and the start does
// not return before it is done, so release never races a mount.
func (r runnerDirResource) acquire(s *starting) *failure {
	dir, err := r.e.runnerDir(s.t)
	if err == nil {
		// The bind's source exists from here on: Docker checks it at
		// create, and binds what is mounted there at start.
		err = os.MkdirAll(dir, 0o755)
	}
	if err == nil {
		err = os.MkdirAll(r.e.hostFSProbe(), 0o555)
	}
	if err != nil {
		return failf(api.ReasonExecutorError, "prepare runner dir error: %v", err)
	}
	if h, ok := r.e.cfg.RunnerDirs.(startHolder); ok {
		// The next ready copy waits until this start is over.
		s.onReturn(h.Hold())
	}
	s.dir, s.dirReady = dir, r.e.makeRunnerDir(s.ctx, dir)
	s.onReturn(func() { _ = s.dirReady() })
	return nil
}

func (r runnerDirResource) restore(t *task, log *slog.Logger) {
	dir, err := r.e.runnerDir(t)
	if err != nil {
		return
	}
	// After a reboot its filesystem is no longer mounted: the job's final
	// state and log are in it.
	if err := r.e.cfg.RunnerDirs.Attach(dir); err != nil {
		log.Warn("runner dir not re-attached", "dir", dir, "err", err)
	}
}

func (r runnerDirResource) remove(_ context.Context, t *task) error {
	dir, err := r.e.runnerDir(t)
	if err != nil {
		return nil // a damaged record's task has no dir
	}
	if err := r.e.cfg.RunnerDirs.Remove(dir); err != nil {
		return fmt.Errorf("remove runner dir: %w", err)
	}
	return nil
}

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
	s.gpus = slices.Clone(t.gpuIDs)
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
	t.contID = id
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
	t.contID = c.ID
	if c.Ports != nil && !forwarded {
		t.ports = c.Ports
	}
}

// remove removes it by id and by name (removeOwn), unless the pipeline
// never reached create: then Docker holds nothing of the task, and
// removing it needs no Docker (which may be the very thing missing).
func (r containerResource) remove(ctx context.Context, t *task) error {
	t.mu.Lock()
	none := t.noContainer
	t.mu.Unlock()
	if none {
		return nil
	}
	return r.e.removeOwn(ctx, t)
}

// gpuResource is the task's GPUs, locked in the engine's gpu.Locks.
type gpuResource struct{ e *Engine }

func (r gpuResource) acquire(s *starting) *failure {
	t := s.t
	ids := []string{}
	if t.cfg.GPU != 0 {
		got, err := r.e.gpus.Acquire(t.cfg.ID, t.cfg.GPU)
		if err != nil {
			return &failure{api.ReasonExecutorError, err.Error()}
		}
		ids = got
	}
	t.mu.Lock()
	t.gpuIDs = ids // persisted with the container id: locks start empty after a restart
	t.mu.Unlock()
	return nil
}

func (gpuResource) kind() string { return "gpus" }

func (r gpuResource) release(t *task, _ *slog.Logger) error {
	t.mu.Lock()
	ids := slices.Clone(t.gpuIDs)
	t.mu.Unlock()
	if len(ids) > 0 {
		r.e.gpus.Release(t.cfg.ID, ids)
	}
	return nil
}

func (r gpuResource) reclaim(t *task, log *slog.Logger) {
	t.mu.Lock()
	ids := slices.Clone(t.gpuIDs)
	t.mu.Unlock()
	if len(ids) > 0 {
		if err := r.e.gpus.Lock(t.cfg.ID, ids); err != nil {
			log.Error("the task's GPUs are held by another task", "gpus", ids, "err", err)
		}
	}
}

// hostKeysResource is the task's lines in a host user's authorized_keys.
type hostKeysResource struct{ e *Engine }

func (r hostKeysResource) acquire(s *starting) *failure {
	t := s.t
	if len(t.cfg.HostSSHKeys) == 0 || t.cfg.HostSSHUser == "" {
		return nil
	}
	if r.e.keys == nil {
		return &failure{api.ReasonExecutorError, "host keys error: no authorized_keys editor"}
	}
	// Recorded before the edit: a crash in between leaves a removal that
	// finds nothing, never a line nobody removes.
	t.mu.Lock()
	t.keysAdded = true
	t.mu.Unlock()
	if err := r.e.save(t); err != nil {
		return &failure{api.ReasonExecutorError, fmt.Sprintf("host keys error: the task's record cannot be saved, so no key is added: %v", err)}
	}
	if err := r.e.keys.Add(t.cfg.HostSSHUser, t.cfg.ID, t.cfg.HostSSHKeys); err != nil {
		return &failure{api.ReasonExecutorError, fmt.Sprintf("host keys error: %v", err)}
	}
	return nil
}

func (hostKeysResource) kind() string { return "host_keys" }

func (r hostKeysResource) release(t *task, _ *slog.Logger) error {
	t.mu.Lock()
	added, user := t.keysAdded, t.cfg.HostSSHUser
	t.mu.Unlock()
	if added && r.e.keys != nil {
		if err := r.e.keys.Remove(user, t.cfg.ID); err != nil {
			return fmt.Errorf("remove host keys of %s: %w", user, err)
		}
	}
	return nil
}

// hostKeysResource has no reclaim: the lines stay in the file across
// restarts.

// volumesResource is the task's network volumes, mounted on the host.
type volumesResource struct{ e *Engine }

func (r volumesResource) acquire(s *starting) *failure {
	ctx, t := s.ctx, s.t
	if len(t.cfg.Volumes) == 0 {
		return nil
	}
	if r.e.cfg.Volumes == nil {
		return &failure{api.ReasonExecutorError, "prepareVolumes error: this shim has no volume support configured"}
	}
	// Recorded before mounting: after any crash, release unmounts them (a
	// no-op for those never mounted).
	names := make([]string, 0, len(t.cfg.Volumes))
	for _, v := range t.cfg.Volumes {
		names = append(names, v.Name)
	}
	t.mu.Lock()
	t.volumes = names
	t.mu.Unlock()
	if err := r.e.save(t); err != nil {
		return &failure{api.ReasonExecutorError, fmt.Sprintf("prepareVolumes error: the task's record cannot be saved, so nothing is mounted: %v", err)}
	}
	for _, v := range t.cfg.Volumes {
		if err := r.e.cfg.Volumes.Mount(ctx, t.cfg.ID, v); err != nil {
			return &failure{api.ReasonExecutorError, fmt.Sprintf("prepareVolumes error: %v", err)}
		}
	}
	return nil
}

func (volumesResource) kind() string { return "volumes" }

func (r volumesResource) release(t *task, log *slog.Logger) error {
	t.mu.Lock()
	vols := slices.Clone(t.volumes)
	t.mu.Unlock()
	var errs []error
	for _, v := range vols {
		if r.e.cfg.Volumes == nil {
			log.Error("a volume is recorded but this shim has no volume support", "volume", v)
			continue
		}
		if err := r.e.cfg.Volumes.Unmount(v, t.cfg.ID); err != nil {
			errs = append(errs, fmt.Errorf("unmount volume %s: %w", v, err))
		}
	}
	return errors.Join(errs...)
}

func (r volumesResource) reclaim(t *task, log *slog.Logger) {
	t.mu.Lock()
	vols := slices.Clone(t.volumes)
	t.mu.Unlock()
	if r.e.cfg.Volumes == nil {
		return
	}
	for _, v := range vols {
		if err := r.e.cfg.Volumes.Claim(v, t.cfg.ID); err != nil {
			log.Error("the task's volume is claimed twice", "volume", v, "err", err)
		}
	}
}

// instanceMountsResource is the host directories bound into the task. They
// are made when missing and never removed: host data outlives every task.
type instanceMountsResource struct{ e *Engine }

func (r instanceMountsResource) acquire(s *starting) *failure {
	t := s.t
	if err := r.e.prepareInstanceMounts(t.cfg.InstanceMounts); err != nil {
		return &failure{api.ReasonExecutorError, fmt.Sprintf("prepareInstanceMountPoints error: %v", err)}
	}
	return nil
}

func (instanceMountsResource) kind() string { return "instance_mounts" }

// networkResource is the isolated bridge network a bridge-mode task joins
// (shim/netiso). It is shared by every task and kept when one ends; a
// per-task network would delete its own here.
type networkResource struct{ e *Engine }

func (r networkResource) acquire(s *starting) *failure {
	ctx, t := s.ctx, s.t
	if t.cfg.NetworkMode != "bridge" || r.e.cfg.Network == nil {
		return nil
	}
	name, err := r.e.cfg.Network.Ensure(ctx)
	if err != nil {
		return &failure{api.ReasonCreatingContainerError, fmt.Sprintf("isolated network error: %v", err)}
	}
	t.mu.Lock()
	t.network = name
	t.mu.Unlock()
	return nil
}

func (networkResource) kind() string { return "network" }

// forwardResource is a bridge task's runner ports, forwarded by the shim
// (shim/portfwd). They are opened once the container has an address (here,
// and recovery's re-attach) and closed when the task ends. Without a
// Forwarder its ports are Docker's (none in host mode).
type forwardResource struct{ e *Engine }

func (forwardResource) kind() string { return "forwards" }

// forwarded says whether t's container c has the shim's forwards: a
// bridge task whose container Docker publishes nothing for.
func (e *Engine) forwarded(t *task, c ContainerState) bool {
	return t.cfg.NetworkMode != "host" && e.cfg.Forwarder != nil && len(c.Ports) == 0
}

// reattach opens the forwards again, which died with the shim, on the
// ports the server was told.
func (r forwardResource) reattach(ctx context.Context, t *task, c ContainerState, log *slog.Logger) {
	if !r.e.forwarded(t, c) || !c.Running {
		return
	}
	t.mu.Lock()
	recorded := t.ports
	t.mu.Unlock()
	ports, err := r.e.forward(ctx, t, c.ID, recorded)
	if err != nil {
		log.Error("re-open the task's forwarded ports", "err", err, "ports", recorded)
		return
	}
	t.mu.Lock()
	t.ports = ports
	t.mu.Unlock()
}

// acquire learns the ports the server is told: forwarded here, or Docker's.
func (r forwardResource) acquire(s *starting) *failure {
	e, ctx := r.e, context.WithoutCancel(s.ctx)
	s.ports = []api.PortMapping{}
	switch {
	case s.t.cfg.NetworkMode == "host":
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
	default:
		ports, err := e.rt.Ports(ctx, s.id)
		if err != nil {
			s.log.Error("discover ports", "err", err)
			ports = []api.PortMapping{}
		}
		s.ports = ports
	}
	return nil
}

func (r forwardResource) release(t *task, _ *slog.Logger) error {
	if r.e.cfg.Forwarder != nil {
		r.e.cfg.Forwarder.Close(t.cfg.ID)
	}
	return nil
}
