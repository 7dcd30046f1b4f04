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
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

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

// failure is how a pipeline stage ends a task.
type failure struct {
	reason api.TerminationReason
	msg    string
}

// starting is one start of a task: what its kinds' acquire share.
type starting struct {
	ctx context.Context
	t   *task
	log *slog.Logger

	dir       string       // the runner dir (runnerDirResource)
	dirReady  func() error // waits for its filesystem, the same error each call
	ref       string       // the image (imageResource), as imageRef normalized it
	reuse     bool         // a pinned image present locally is used as is
	gpus      []string     // the GPUs the container gets
	id        string       // the container (containerResource)
	ports     []api.PortMapping
	published []api.PublishedPort // the job's, as Docker bound them

	now    func() time.Time
	began  time.Time // the current stage's start
	phases []any     // the timing line: stage, duration, ...
	undo   []func()  // run, in reverse, when the start returns
}

// mark ends a stage of the timing line.
func (s *starting) mark(name string) {
	now := s.now()
	s.phases = append(s.phases, name, now.Sub(s.began).Round(100*time.Microsecond))
	s.began = now
}

// onReturn runs f when the start returns, whatever its outcome.
func (s *starting) onReturn(f func()) { s.undo = append(s.undo, f) }

func (s *starting) finish() {
	for i := len(s.undo) - 1; i >= 0; i-- {
		s.undo[i]()
	}
}

// failf is a start failure.
func failf(reason api.TerminationReason, format string, args ...any) *failure {
	return &failure{reason, fmt.Sprintf(format, args...)}
}

// aborted is a start cut short by a terminate.
func aborted() *failure {
	return failf(api.ReasonTerminatedByServer, "terminated before start")
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
	// Published are the job's published ports as Docker bound them
	// (TaskDetails.Published).
	Published []api.PublishedPort `json:"published,omitempty"`
	// None: the task ended before create; trusted only together with a
	// terminated status (restored).
	None bool `json:"none,omitempty"`
}

// heldOf is what t holds, for its record; t.mu held.
func heldOf(t *task) held {
	h := t.held
	h.Container.Name, h.Container.Ports = t.name, slices.Clone(h.Container.Ports)
	h.Container.Published = slices.Clone(h.Container.Published)
	h.GPUs, h.Volumes = slices.Clone(h.GPUs), slices.Clone(h.Volumes)
	return h
}

// setHeld gives a task read back from its record (status set) what the
// record says it holds.
func (t *task) setHeld(h held, status api.TaskStatus) {
	t.name, t.held = h.Container.Name, h
	t.held.Container.Name = ""
	// A record written before the task ended may predate its create: only
	// a terminated one is sure that Docker never got a container.
	t.held.Container.None = h.Container.None && status == api.TaskTerminated
}

// newResources is the acquire order; release and remove walk it backwards.
func newResources(e *Engine) []resource {
	return []resource{runnerDirResource{e}, gpuResource{e}, hostKeysResource{e}, volumesResource{e}, instanceMountsResource{e},
		networkResource{e}, imageResource{e}, containerResource{e}, forwardResource{e}}
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
	t.held.GPUs = ids // persisted with the container id: locks start empty after a restart
	t.mu.Unlock()
	return nil
}

func (gpuResource) kind() string { return "gpus" }

func (r gpuResource) release(t *task, _ *slog.Logger) error {
	t.mu.Lock()
	ids := slices.Clone(t.held.GPUs)
	t.mu.Unlock()
	if len(ids) > 0 {
		r.e.gpus.Release(t.cfg.ID, ids)
	}
	return nil
}

func (r gpuResource) reclaim(t *task, log *slog.Logger) {
	t.mu.Lock()
	ids := slices.Clone(t.held.GPUs)
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
	t.held.HostKeys = true
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
	added, user := t.held.HostKeys, t.cfg.HostSSHUser
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
	t.held.Volumes = names
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
	vols := slices.Clone(t.held.Volumes)
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
	vols := slices.Clone(t.held.Volumes)
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
