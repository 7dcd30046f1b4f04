// Package task owns the shim's tasks: their records and state machine, the
// start pipeline that turns a task config into a running container, and
// terminate/remove. HTTP lives elsewhere; this package speaks api types.
package task

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/distribution/reference"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/ident"
	"github.com/tandem-run/tandem/shim/gpu"
	"github.com/tandem-run/tandem/shim/pull"
)

// Error classes; the HTTP layer maps them to statuses.
var (
	ErrNotFound = errors.New("task not found")
	ErrConflict = errors.New("request error")
	ErrInvalid  = errors.New("invalid task")
	// ErrNotReady means the shim is still restoring tasks after a start.
	ErrNotReady = errors.New("the shim is restoring its tasks after a start; retry shortly")
)

// Labels put on every task container (dstack's, used for recovery).
const (
	LabelIsTask = "ai.dstack.shim.is-task"
	LabelTaskID = "ai.dstack.shim.task-id"
)

// Paths inside the container.
const (
	RunnerDirInContainer    = "/tmp/runner"
	RunnerBinaryInContainer = "/usr/local/bin/dstack-runner"
)

// KeyEditor adds and removes a task's keys in a host user's authorized_keys.
type KeyEditor interface {
	Add(username, taskID string, keys []string) error
	Remove(username, taskID string) error
}

// Volumes mounts network volumes for tasks (shim/volume implements it).
type Volumes interface {
	Mount(ctx context.Context, taskID string, v api.VolumeInfo) error
	Unmount(name, taskID string) error
	Claim(name, taskID string) error
}

// Config is how the engine runs tasks.
type Config struct {
	// Volumes mounts network volumes; nil refuses tasks that ask for them.
	Volumes           Volumes
	Home              string // shim home; runner dirs live in <home>/runners
	RunnerBinary      string // host path bind-mounted into every container
	RunnerHTTPPort    int
	RunnerSSHPort     int
	RunnerLogLevel    string
	RunnerSSHLogLevel string
	Env               []string // pass-env values and PJRT_DEVICE, as NAME=value
	Privileged        bool
	VolumesRoot       string // where network volumes are mounted
	InfinibandPath    string // "/dev/infiniband"; passed through when it exists
	PullStallTimeout  time.Duration
	PullTimeout       time.Duration
	// TerminateWait bounds how long terminate waits for the pipeline to wind
	// down after the container stopped or a pre-run stage was cancelled.
	TerminateWait time.Duration
	// GPUVendor is the host's GPU vendor; NvidiaCDI selects CDI device
	// requests instead of the NVIDIA runtime hook.
	GPUVendor api.GPUVendor
	NvidiaCDI bool
}

// nvidiaCapabilities are the driver capabilities a task gets (dstack's).
var nvidiaCapabilities = []string{"gpu", "utility", "compute", "graphics", "video", "display", "compat32"}

// Engine runs tasks.
type Engine struct {
	cfg  Config
	rt   Runtime
	gpus *gpu.Locks
	keys KeyEditor
	log  *slog.Logger
	now  func() time.Time

	mu         sync.RWMutex // guards tasks, tombstones and every task's record fields
	tasks      map[string]*task
	tombstones map[string]time.Time // removed ids (tombstone.go)
	wg         sync.WaitGroup       // pipelines
	recs       *records             // nil: tasks are not persisted
	writers    int                  // background record writers running; guarded by mu
	idle       *sync.Cond           // signalled (on mu) when writers drops to 0
}

// saveSoon persists t in the background, coalescing bursts into one write
// of the latest state. Used on the start path, where recovery already copes
// with a record one step behind (a pending or creating record whose
// container exists is reconciled or cleaned up).
func (e *Engine) saveSoon(t *task) {
	if e.recs == nil {
		return
	}
	e.mu.Lock()
	t.dirty = true
	if t.writing {
		e.mu.Unlock()
		return
	}
	t.writing = true
	e.writers++
	e.mu.Unlock()
	go func() {
		for {
			e.mu.Lock()
			if !t.dirty {
				t.writing = false
				e.writers--
				if e.writers == 0 {
					e.idle.Broadcast()
				}
				e.mu.Unlock()
				return
			}
			t.dirty = false
			e.mu.Unlock()
			e.save(t)
		}
	}()
}

// Sync waits until no background record write is running.
func (e *Engine) Sync() {
	e.mu.Lock()
	defer e.mu.Unlock()
	for e.writers > 0 {
		e.idle.Wait()
	}
}

// task is one task. Record fields are guarded by Engine.mu; op serializes
// terminate and remove of this task (they wait, never crash, on each other).
type task struct {
	op sync.Mutex

	cfg       api.TaskConfig
	pwHash    string // hashPassword of the registry password (records keep only this)
	status    api.TaskStatus
	reason    api.TerminationReason
	message   string
	name      string // container name
	contID    string
	ports     []api.PortMapping
	gpuIDs    []string
	tracker   *pull.Tracker
	stopReq   *api.TaskTerminateRequest // set by terminate
	cancelPre context.CancelFunc        // aborts stages before running
	done      chan struct{}             // closed when the pipeline ended
	keysAdded bool                      // host keys are in authorized_keys
	volumes   []string                  // volumes that may be mounted for it
	released  bool                      // GPUs and keys given back
	watched   bool                      // a goroutine waits for its container
	dirty     bool                      // a newer state awaits writing
	writing   bool                      // a background writer runs

	saveMu sync.Mutex // serializes this task's record writes (lock order: saveMu, then Engine.mu)
}

// New returns an engine. gpus may hold no GPUs; keys may be nil when no
// task asks for host keys.
func New(cfg Config, rt Runtime, gpus *gpu.Locks, keys KeyEditor, log *slog.Logger) *Engine {
	if cfg.TerminateWait == 0 {
		cfg.TerminateWait = 30 * time.Second
	}
	if cfg.PullStallTimeout == 0 {
		cfg.PullStallTimeout = 2 * time.Minute
	}
	if cfg.VolumesRoot == "" {
		cfg.VolumesRoot = "/mnt/disks/dstack-volumes"
	}
	if cfg.InfinibandPath == "" {
		cfg.InfinibandPath = "/dev/infiniband"
	}
	e := &Engine{cfg: cfg, rt: rt, gpus: gpus, keys: keys, log: log, now: time.Now, tasks: map[string]*task{}}
	e.idle = sync.NewCond(&e.mu)
	if cfg.Home != "" {
		e.recs = &records{dir: filepath.Join(cfg.Home, "tasks")}
	}
	return e
}

// save writes t's record. Each call snapshots the latest state, and writes
// of one task are serialized, so the file never goes back in time.
func (e *Engine) save(t *task) {
	if e.recs == nil {
		return
	}
	t.saveMu.Lock()
	defer t.saveMu.Unlock()
	e.mu.RLock()
	if e.tasks[t.cfg.ID] != t { // removed meanwhile: no resurrection
		e.mu.RUnlock()
		return
	}
	rec := record{Config: t.cfg, Status: t.status, Reason: t.reason, Message: t.message, ContainerName: t.name,
		ContainerID: t.contID, Ports: slices.Clone(t.ports), GPUIDs: slices.Clone(t.gpuIDs), KeysAdded: t.keysAdded,
		Volumes: slices.Clone(t.volumes), Released: t.released, StopRequest: t.stopReq, PasswordHash: t.pwHash}
	e.mu.RUnlock()
	if err := e.recs.save(rec); err != nil {
		e.log.Error("persist task", "task_id", t.cfg.ID, "err", err)
	}
}

// ContainerName is dstack's deterministic name: <name>-<8 hex of sha256(name/id)>.
func ContainerName(name, id string) string {
	sum := sha256.Sum256([]byte(name + "/" + id))
	return name + "-" + hex.EncodeToString(sum[:])[:8]
}

// normalize fills dstack's defaults so that equal requests compare equal.
func normalize(c api.TaskConfig) api.TaskConfig {
	if c.ContainerUser == "" {
		c.ContainerUser = "root"
	}
	if c.NetworkMode == "" {
		c.NetworkMode = "host"
	}
	emptyNil := func(v any) {
		rv := reflect.ValueOf(v).Elem()
		if rv.Len() == 0 {
			rv.Set(reflect.Zero(rv.Type()))
		}
	}
	emptyNil(&c.Volumes)
	emptyNil(&c.VolumeMounts)
	emptyNil(&c.InstanceMounts)
	emptyNil(&c.GPUDevices)
	emptyNil(&c.HostSSHKeys)
	emptyNil(&c.ContainerSSHKeys)
	return c
}

func validate(c api.TaskConfig) error {
	switch { // dstack's own texts for the empty cases
	case c.ID == "":
		return fmt.Errorf("%w: empty id", ErrInvalid)
	case c.Name == "":
		return fmt.Errorf("%w: empty name", ErrInvalid)
	}
	if err := ident.TaskID(c.ID); err != nil {
		return fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	if err := ident.TaskName(c.Name); err != nil {
		return fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	switch {
	case c.ImageName == "":
		return fmt.Errorf("%w: empty image_name", ErrInvalid)
	case c.GPU < -1:
		return fmt.Errorf("%w: gpu must be -1, 0 or a positive count, got %d", ErrInvalid, c.GPU)
	case c.CPU < 0 || c.Memory < 0 || c.ShmSize < 0:
		return fmt.Errorf("%w: cpu, memory and shm_size must not be negative", ErrInvalid)
	}
	for i, v := range c.Volumes {
		if err := ident.VolumeName(v.Name); err != nil {
			return fmt.Errorf("%w: volumes[%d]: %v", ErrInvalid, i, err)
		}
	}
	for i, v := range c.VolumeMounts {
		if err := ident.VolumeName(v.Name); err != nil {
			return fmt.Errorf("%w: volume_mounts[%d]: %v", ErrInvalid, i, err)
		}
		if !filepath.IsAbs(v.Path) {
			return fmt.Errorf("%w: volume_mounts[%d]: path %q must be absolute", ErrInvalid, i, v.Path)
		}
	}
	return nil
}

// sameSubmit says whether cfg repeats t's submit. A task restored from its
// record has no registry password, only its hash: the rest must be equal
// and the password must match the hash.
func sameSubmit(t *task, cfg api.TaskConfig) bool {
	if reflect.DeepEqual(t.cfg, cfg) {
		return true
	}
	if t.cfg.RegistryPassword != "" || t.pwHash == "" {
		return false
	}
	bare := cfg
	bare.RegistryPassword = ""
	return reflect.DeepEqual(t.cfg, bare) && passwordMatches(t.pwHash, cfg.RegistryPassword)
}

// Submit stores the task as pending and starts its pipeline. Re-submitting
// the same config under the same id is idempotent; a different one conflicts.
func (e *Engine) Submit(cfg api.TaskConfig) (api.TaskInfoResponse, error) {
	if err := validate(cfg); err != nil {
		return api.TaskInfoResponse{}, err
	}
	cfg = normalize(cfg)
	e.mu.Lock()
	if t, ok := e.tasks[cfg.ID]; ok {
		same := sameSubmit(t, cfg)
		info := e.infoLocked(t)
		e.mu.Unlock()
		if same {
			return info, nil
		}
		return api.TaskInfoResponse{}, fmt.Errorf("%w: task %s is already submitted", ErrConflict, cfg.ID)
	}
	delete(e.tombstones, cfg.ID) // a new submit under a removed id is a new task
	ctx, cancel := context.WithCancel(context.Background())
	t := &task{
		cfg:       cfg,
		pwHash:    hashPassword(cfg.RegistryPassword),
		status:    api.TaskPending,
		name:      ContainerName(cfg.Name, cfg.ID),
		tracker:   pull.NewTracker(e.now),
		cancelPre: cancel,
		done:      make(chan struct{}),
	}
	e.tasks[cfg.ID] = t
	info := e.infoLocked(t)
	e.wg.Add(1)
	e.mu.Unlock()
	e.save(t)
	go func() {
		defer e.wg.Done()
		e.run(ctx, t)
	}()
	return info, nil
}

// Get returns one task.
func (e *Engine) Get(id string) (api.TaskInfoResponse, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	t, ok := e.tasks[id]
	if !ok {
		return api.TaskInfoResponse{}, ErrNotFound
	}
	return e.infoLocked(t), nil
}

// List returns all tasks, sorted by id.
func (e *Engine) List() []api.TaskListItem {
	e.mu.RLock()
	defer e.mu.RUnlock()
	out := make([]api.TaskListItem, 0, len(e.tasks))
	for id, t := range e.tasks {
		out = append(out, api.TaskListItem{ID: id, Status: t.status})
	}
	slices.SortFunc(out, func(a, b api.TaskListItem) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// GPUIDs returns the GPUs a task holds (for metrics filtering).
func (e *Engine) GPUIDs(id string) ([]string, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	t, ok := e.tasks[id]
	if !ok {
		return nil, ErrNotFound
	}
	return slices.Clone(t.gpuIDs), nil
}

func (e *Engine) infoLocked(t *task) api.TaskInfoResponse {
	info := api.TaskInfoResponse{
		ID:                 t.cfg.ID,
		Status:             t.status,
		TerminationReason:  t.reason,
		TerminationMessage: t.message,
		Ports:              slices.Clone(t.ports),
		ContainerName:      t.name,
		ContainerID:        t.contID,
		GPUIDs:             slices.Clone(t.gpuIDs),
	}
	if t.ports != nil && info.Ports == nil {
		info.Ports = []api.PortMapping{}
	}
	if t.gpuIDs != nil && info.GPUIDs == nil {
		info.GPUIDs = []string{}
	}
	if t.status != api.TaskPending && t.status != api.TaskPreparing {
		info.ImagePullProgress = t.tracker.Progress()
	}
	return info
}

// errTransition means the task moved on (terminated) under the pipeline.
var errTransition = errors.New("status transition rejected")

// commit moves t to next, applying update under the lock. Only running is
// persisted here: recovery treats every status before it alike (the
// pipeline died, the task ends), so writing preparing, pulling and creating
// would buy nothing but fsyncs on the start path. What recovery does need
// is written where it happens: the submit, host keys before the edit, the
// container id, running, terminated and stop requests.
func (e *Engine) commit(t *task, next api.TaskStatus, update func()) error {
	if err := e.commitLocked(t, next, update); err != nil {
		return err
	}
	if next == api.TaskRunning {
		e.saveSoon(t)
	}
	return nil
}

func (e *Engine) commitLocked(t *task, next api.TaskStatus, update func()) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if !t.status.CanTransitionTo(next) {
		return fmt.Errorf("%w: %s -> %s", errTransition, t.status, next)
	}
	// A pending terminate blocks every step forward: the pipeline winds down.
	if t.stopReq != nil && next != api.TaskTerminated {
		return fmt.Errorf("%w: terminate requested", errTransition)
	}
	if update != nil {
		update()
	}
	t.status = next
	return nil
}

// finish commits terminated. A reason already recorded wins; a terminate
// request's reason beats the pipeline's; never an empty reason.
func (e *Engine) finish(t *task, reason api.TerminationReason, msg string) {
	e.finishLocked(t, reason, msg)
	e.saveSoon(t)
}

func (e *Engine) finishLocked(t *task, reason api.TerminationReason, msg string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if t.status == api.TaskTerminated && t.reason != "" {
		return
	}
	if t.stopReq != nil {
		reason, msg = t.stopReq.TerminationReason, t.stopReq.TerminationMessage
		if !reason.Valid() {
			reason = api.ReasonTerminatedByServer
		}
	}
	if !reason.Valid() {
		reason = api.ReasonExecutorError
	}
	t.status, t.reason, t.message = api.TaskTerminated, reason, msg
}

// runnerDir is <home>/runners/<container name>; a name that is not one path
// component (a damaged record) has no dir, never a parent's.
func (e *Engine) runnerDir(t *task) (string, error) {
	if t.name == "" || t.name != filepath.Base(t.name) || t.name == "." || t.name == ".." {
		return "", fmt.Errorf("task %s has no valid container name (%q)", t.cfg.ID, t.name)
	}
	return filepath.Join(e.cfg.Home, "runners", t.name), nil
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
	defer close(t.done)
	defer t.cancelPre()
	if f := e.start(ctx, t, log); f != nil {
		e.end(t, log, *f)
		return
	}
	e.watch(t, log)
}

// end releases the task's host resources, then commits terminated, so a
// terminated task never still holds GPUs or keys.
func (e *Engine) end(t *task, log *slog.Logger, f failure) {
	e.release(t, log)
	e.finish(t, f.reason, f.msg)
	log.Info("task terminated", "reason", f.reason, "message", f.msg)
}

// release gives back the task's GPUs and host keys, exactly once.
func (e *Engine) release(t *task, log *slog.Logger) {
	e.mu.Lock()
	if t.released {
		e.mu.Unlock()
		return
	}
	t.released = true
	ids, keys, user, vols := slices.Clone(t.gpuIDs), t.keysAdded, t.cfg.HostSSHUser, slices.Clone(t.volumes)
	e.mu.Unlock()
	for _, v := range vols {
		if e.cfg.Volumes == nil {
			log.Error("a volume is recorded but this shim has no volume support", "volume", v)
			continue
		}
		if err := e.cfg.Volumes.Unmount(v, t.cfg.ID); err != nil {
			log.Error("unmount volume", "volume", v, "err", err)
		}
	}
	if len(ids) > 0 {
		e.gpus.Release(t.cfg.ID, ids)
	}
	if keys && e.keys != nil {
		if err := e.keys.Remove(user, t.cfg.ID); err != nil {
			log.Error("remove host keys", "err", err)
		}
	}
	e.saveSoon(t)
}

// watch waits for the running container to exit, whoever stops it, and
// ends the task with the matching reason.
func (e *Engine) watch(t *task, log *slog.Logger) {
	e.mu.RLock()
	id := t.contID
	e.mu.RUnlock()
	code, err := e.waitExit(id, log)
	switch {
	case errors.Is(err, ErrContainerGone):
		e.end(t, log, failure{api.ReasonContainerExitedWithError, "the container disappeared"})
	case err != nil:
		e.end(t, log, failure{api.ReasonContainerExitedWithError, err.Error()})
	case code == 0:
		e.end(t, log, failure{api.ReasonDoneByRunner, ""})
	default:
		lctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		tailText, lerr := e.rt.LogTail(lctx, id, 5)
		cancel()
		if lerr != nil {
			log.Warn("read container log tail", "err", lerr)
		}
		if tailText == "" {
			tailText = fmt.Sprintf("container exited with code %d", code)
		}
		e.end(t, log, failure{api.ReasonContainerExitedWithError, tailText})
	}
}

// waitExit waits for a container to stop. A wait cut by a Docker restart is
// resumed (the task stays running meanwhile); only a container that is
// really gone or stopped ends it.
func (e *Engine) waitExit(id string, log *slog.Logger) (int, error) {
	backoff := 500 * time.Millisecond
	for {
		code, err := e.rt.Wait(context.Background(), id)
		if err == nil {
			return code, nil
		}
		st, ierr := e.rt.Inspect(context.Background(), id)
		switch {
		case errors.Is(ierr, ErrContainerGone):
			return -1, ErrContainerGone
		case ierr == nil && !st.Running:
			return st.ExitCode, nil
		}
		log.Warn("lost the wait on the container; retrying", "err", err, "retry_in", backoff)
		time.Sleep(backoff)
		backoff = min(backoff*2, 10*time.Second)
	}
}

// start runs the stages up to a running container. A nil result means the
// container runs; cleanups collects what must be undone when the task ends.
func (e *Engine) start(ctx context.Context, t *task, log *slog.Logger) *failure {
	fail := func(reason api.TerminationReason, format string, args ...any) *failure {
		return &failure{reason, fmt.Sprintf(format, args...)}
	}
	aborted := func() *failure {
		return fail(api.ReasonTerminatedByServer, "terminated before start")
	}
	cfg := t.cfg
	began := e.now()
	var phases []any
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
		err = os.MkdirAll(dir, 0o755)
	}
	if err != nil {
		return fail(api.ReasonExecutorError, "prepare runner dir error: %v", err)
	}

	gpuIDs := []string{}
	if cfg.GPU != 0 {
		ids, err := e.gpus.Acquire(cfg.ID, cfg.GPU)
		if err != nil {
			return fail(api.ReasonExecutorError, "%v", err)
		}
		gpuIDs = ids
	}
	e.mu.Lock()
	t.gpuIDs = gpuIDs // persisted with the container id: locks start empty after a restart
	e.mu.Unlock()

	if len(cfg.HostSSHKeys) > 0 && cfg.HostSSHUser != "" {
		if e.keys == nil {
			return fail(api.ReasonExecutorError, "host keys error: no authorized_keys editor")
		}
		// Recorded before the edit: a crash in between leaves a removal that
		// finds nothing, never a line nobody removes.
		e.mu.Lock()
		t.keysAdded = true
		e.mu.Unlock()
		e.save(t)
		if err := e.keys.Add(cfg.HostSSHUser, cfg.ID, cfg.HostSSHKeys); err != nil {
			return fail(api.ReasonExecutorError, "host keys error: %v", err)
		}
	}
	if len(cfg.Volumes) > 0 {
		if e.cfg.Volumes == nil {
			return fail(api.ReasonExecutorError, "prepareVolumes error: this shim has no volume support configured")
		}
		// Recorded before mounting: after any crash, release unmounts them
		// (a no-op for those never mounted).
		names := make([]string, 0, len(cfg.Volumes))
		for _, v := range cfg.Volumes {
			names = append(names, v.Name)
		}
		e.mu.Lock()
		t.volumes = names
		e.mu.Unlock()
		e.save(t)
		for _, v := range cfg.Volumes {
			if err := e.cfg.Volumes.Mount(ctx, cfg.ID, v); err != nil {
				return fail(api.ReasonExecutorError, "prepareVolumes error: %v", err)
			}
		}
	}
	if err := e.prepareInstanceMounts(cfg.InstanceMounts); err != nil {
		return fail(api.ReasonExecutorError, "prepareInstanceMountPoints error: %v", err)
	}
	if ctx.Err() != nil {
		return aborted()
	}

	mark("prepare")
	if err := e.commit(t, api.TaskPulling, nil); err != nil {
		return aborted()
	}
	if err := e.pullImage(ctx, t, dir, log); err != nil {
		if ctx.Err() != nil {
			return aborted()
		}
		return fail(api.ReasonCreatingContainerError, "pullImage error: %v", err)
	}

	mark("pull")
	if err := e.commit(t, api.TaskCreating, nil); err != nil {
		return aborted()
	}
	spec := e.containerSpec(t, dir, gpuIDs)
	// Create must not be cut off halfway by a terminate: we want the id, so
	// that remove can find what Docker made.
	id, err := e.rt.Create(context.WithoutCancel(ctx), spec)
	if err != nil {
		return fail(api.ReasonCreatingContainerError, "createContainer error: %v", err)
	}
	mark("create")
	e.mu.Lock()
	t.contID = id
	e.mu.Unlock()
	e.saveSoon(t)
	if ctx.Err() != nil {
		return aborted()
	}
	err = e.rt.Start(context.WithoutCancel(ctx), id)
	if err != nil && strings.Contains(err.Error(), "/dev/nvidia-modeset") && spec.GPUs != nil && slices.Contains(spec.GPUs.Capabilities, "display") {
		log.Warn("no /dev/nvidia-modeset on this host; starting without the display capability", "err", err)
		_ = e.rt.Remove(context.WithoutCancel(ctx), id)
		spec = withoutDisplay(spec)
		if id, err = e.rt.Create(context.WithoutCancel(ctx), spec); err == nil {
			e.mu.Lock()
			t.contID = id
			e.mu.Unlock()
			e.save(t)
			err = e.rt.Start(context.WithoutCancel(ctx), id)
		}
	}
	if err != nil {
		return fail(api.ReasonCreatingContainerError, "startContainer error: %v", err)
	}
	mark("start")
	ports := []api.PortMapping{}
	if cfg.NetworkMode != "host" {
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
	log.Info("task running", append([]any{"container_id", id, "ports", ports, "gpus", gpuIDs}, phases...)...)
	return nil
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
			if err := os.MkdirAll(clean, 0o755); err != nil {
				return fmt.Errorf("create %s: %w", clean, err)
			}
			if err := os.Chmod(clean, 0o777); err != nil {
				return fmt.Errorf("chmod %s: %w", clean, err)
			}
		} else if err != nil {
			return fmt.Errorf("stat %s: %w", clean, err)
		}
	}
	return nil
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

func (e *Engine) pullImage(ctx context.Context, t *task, dir string, log *slog.Logger) error {
	ref, reuse, err := imageRef(t.cfg.ImageName)
	if err != nil {
		return err
	}
	if reuse {
		present, err := e.rt.ImagePresent(ctx, ref)
		if err != nil {
			return err
		}
		if present {
			log.Debug("image present, not pulling", "image", ref)
			return nil
		}
	}
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
	logFile, err := os.Create(filepath.Join(dir, "pull.log"))
	if err != nil {
		return fmt.Errorf("pull log: %w", err)
	}
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

func (e *Engine) containerSpec(t *task, dir string, gpuIDs []string) ContainerSpec {
	cfg := t.cfg
	cmd := []string{"--log-level", e.cfg.RunnerLogLevel, "start",
		"--temp-dir", RunnerDirInContainer,
		"--http-port", strconv.Itoa(e.cfg.RunnerHTTPPort),
		"--ssh-port", strconv.Itoa(e.cfg.RunnerSSHPort)}
	if cfg.NetworkMode == "host" {
		cmd = append(cmd, "--http-address", "localhost")
	}
	for _, k := range cfg.ContainerSSHKeys {
		cmd = append(cmd, "--ssh-authorized-key", k)
	}
	if e.cfg.RunnerSSHLogLevel != "" {
		cmd = append(cmd, "--ssh-log-level", e.cfg.RunnerSSHLogLevel)
	}
	binds := []Bind{
		{Source: dir, Target: RunnerDirInContainer},
		{Source: e.cfg.RunnerBinary, Target: RunnerBinaryInContainer, ReadOnly: true},
	}
	for _, v := range cfg.VolumeMounts {
		binds = append(binds, Bind{Source: filepath.Join(e.cfg.VolumesRoot, v.Name), Target: v.Path})
	}
	for _, m := range cfg.InstanceMounts {
		binds = append(binds, Bind{Source: filepath.Clean(m.InstancePath), Target: m.Path})
	}
	spec := ContainerSpec{
		Name:        t.name,
		Image:       cfg.ImageName,
		User:        cfg.ContainerUser,
		Entrypoint:  []string{RunnerBinaryInContainer},
		Cmd:         cmd,
		Env:         slices.Clone(e.cfg.Env),
		Labels:      map[string]string{LabelIsTask: "true", LabelTaskID: cfg.ID},
		NetworkMode: cfg.NetworkMode,
		Privileged:  cfg.Privileged || e.cfg.Privileged,
		ExposedTCP:  []int{e.cfg.RunnerHTTPPort, e.cfg.RunnerSSHPort},
		Binds:       binds,
		ShmSize:     cfg.ShmSize,
		NanoCPUs:    int64(cfg.CPU * 1e9),
		Memory:      cfg.Memory,
		Init:        true,
	}
	if len(gpuIDs) > 0 {
		e.wireGPUs(&spec, cfg, gpuIDs)
	}
	if _, err := os.Stat(e.cfg.InfinibandPath); !os.IsNotExist(err) {
		spec.Devices = append(spec.Devices, Device{Host: e.cfg.InfinibandPath, Container: "/dev/infiniband", Perms: "rwm"})
		spec.MemlockUnlimited = true
	}
	return spec
}

// wireGPUs gives the container its GPUs: explicit gpu_devices replace all
// vendor logic; otherwise NVIDIA gets a device request (runtime hook or
// CDI) and AMD the kfd and render nodes with what ROCm needs.
func (e *Engine) wireGPUs(spec *ContainerSpec, cfg api.TaskConfig, gpuIDs []string) {
	if len(cfg.GPUDevices) > 0 {
		for _, d := range cfg.GPUDevices {
			spec.Devices = append(spec.Devices, Device{Host: d.PathOnHost, Container: d.PathInContainer, Perms: "rwm"})
		}
		return
	}
	switch e.cfg.GPUVendor {
	case api.GPUVendorNVIDIA:
		if e.cfg.NvidiaCDI {
			ids := make([]string, 0, len(gpuIDs))
			for _, id := range gpuIDs {
				ids = append(ids, "nvidia.com/gpu="+id)
			}
			spec.GPUs = &GPURequest{Driver: "cdi", DeviceIDs: ids}
			return
		}
		spec.GPUs = &GPURequest{DeviceIDs: slices.Clone(gpuIDs), Capabilities: slices.Clone(nvidiaCapabilities)}
	case api.GPUVendorAMD:
		spec.Devices = append(spec.Devices, Device{Host: "/dev/kfd", Container: "/dev/kfd", Perms: "rwm"})
		for _, id := range gpuIDs {
			spec.Devices = append(spec.Devices, Device{Host: id, Container: id, Perms: "rwm"})
		}
		spec.IpcMode = "host"
		spec.CapAdd = []string{"SYS_PTRACE"}
		spec.SecurityOpt = []string{"seccomp=unconfined"}
	}
}

// withoutDisplay drops the display capability (headless hosts have no
// /dev/nvidia-modeset; dstack issue #4004).
func withoutDisplay(spec ContainerSpec) ContainerSpec {
	if spec.GPUs != nil {
		g := *spec.GPUs
		g.Capabilities = slices.DeleteFunc(slices.Clone(g.Capabilities), func(c string) bool { return c == "display" })
		spec.GPUs = &g
	}
	return spec
}

// StopError is a failure to stop a running container (HTTP 500).
type StopError struct{ Err error }

func (e *StopError) Error() string { return "failed to stop container: " + e.Err.Error() }
func (e *StopError) Unwrap() error { return e.Err }

// Terminate stops a task. It returns once the task is terminated and its
// resources released (or after TerminateWait if the pipeline is stuck).
// Terminating a terminated task keeps its first reason.
func (e *Engine) Terminate(ctx context.Context, id string, req api.TaskTerminateRequest) (api.TaskInfoResponse, error) {
	t, err := e.lockOp(id)
	if err != nil {
		return api.TaskInfoResponse{}, err
	}
	defer t.op.Unlock()

	e.mu.Lock()
	if t.status == api.TaskTerminated {
		info := e.infoLocked(t)
		e.mu.Unlock()
		return info, nil
	}
	if t.stopReq == nil {
		r := req
		t.stopReq = &r
	}
	status, contID := t.status, t.contID
	e.mu.Unlock()
	e.save(t)

	t.cancelPre()
	if status == api.TaskRunning && contID != "" {
		if err := e.rt.Stop(ctx, contID, time.Duration(req.Timeout)*time.Second); err != nil {
			return api.TaskInfoResponse{}, &StopError{Err: err}
		}
	}
	select {
	case <-t.done:
	case <-time.After(time.Duration(req.Timeout)*time.Second + e.cfg.TerminateWait):
		e.log.Warn("pipeline did not wind down in time; marking terminated", "task_id", id)
		e.finish(t, req.TerminationReason, req.TerminationMessage)
	case <-ctx.Done():
		return api.TaskInfoResponse{}, ctx.Err()
	}
	return e.Get(id)
}

// Remove forgets a terminated task, removing its container and runner dir.
func (e *Engine) Remove(ctx context.Context, id string) error {
	t, err := e.lockOp(id)
	if err != nil {
		return err
	}
	defer t.op.Unlock()
	e.mu.RLock()
	status := t.status
	e.mu.RUnlock()
	if status != api.TaskTerminated {
		return fmt.Errorf("%w: cannot remove task %s with %s status", ErrConflict, id, status)
	}
	select {
	case <-t.done:
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(e.cfg.TerminateWait):
		e.log.Warn("removing a task whose pipeline is still winding down", "task_id", id)
	}
	// By name: it also finds a container whose id was never recorded. A
	// task restored from an unreadable record has neither name nor dir.
	if t.name != "" {
		if err := e.rt.Remove(ctx, t.name); err != nil {
			return err
		}
		if dir, err := e.runnerDir(t); err == nil {
			if err := os.RemoveAll(dir); err != nil {
				return fmt.Errorf("remove runner dir: %w", err)
			}
		}
	}
	t.saveMu.Lock() // no save may write the record back after this
	e.mu.Lock()
	delete(e.tasks, id)
	e.bury(id)
	e.mu.Unlock()
	t.saveMu.Unlock()
	if e.recs != nil {
		if err := e.recs.remove(id); err != nil {
			return err
		}
	}
	return nil
}

// lockOp takes the task's op lock, then checks the task still exists (a
// concurrent remove may have won the lock first).
func (e *Engine) lockOp(id string) (*task, error) {
	e.mu.RLock()
	t, ok := e.tasks[id]
	e.mu.RUnlock()
	if !ok {
		return nil, ErrNotFound
	}
	t.op.Lock()
	e.mu.RLock()
	cur, ok := e.tasks[id]
	e.mu.RUnlock()
	if !ok || cur != t {
		t.op.Unlock()
		return nil, ErrNotFound
	}
	return t, nil
}

// UseCDI switches NVIDIA wiring to CDI device requests. The shim learns it
// from Docker after the API already serves; it must be called before any
// task can start (the API holds task calls until recovery is done).
func (e *Engine) UseCDI(v bool) { e.cfg.NvidiaCDI = v }

// Wait blocks until every pipeline has returned (for tests and shutdown of
// tests; the shim itself never stops containers on exit).
func (e *Engine) Wait() { e.wg.Wait() }
