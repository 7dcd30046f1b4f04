// Package task owns the shim's tasks: their records and state machine, the
// start pipeline that turns a task config into a running container, and
// terminate/remove. HTTP lives elsewhere; this package speaks api types.
package task

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/shim/gpu"
	"github.com/tandem-run/tandem/shim/pull"
	"github.com/tandem-run/tandem/shim/runnerdir"
)

// MaxPidsLimit is the largest pids limit a task may ask for.
const MaxPidsLimit = 1 << 22

// DefaultPidsLimit is a task's pids limit on a host whose kernel allows
// pidMax pids: an eighth of them, between 2,048 and 32,768 (a GPU job with
// its data loaders and their threads stays in the hundreds to low
// thousands; eight runaway tasks cannot take the host's pool).
func DefaultPidsLimit(pidMax int64) int64 {
	return min(max(pidMax/8, 2048), 32768)
}

// Error classes; the HTTP layer maps them to statuses.
var (
	ErrNotFound = errors.New("task not found")
	ErrConflict = errors.New("request error")
	ErrInvalid  = errors.New("invalid task")
	// ErrStorage means the shim could not persist what it was asked to do
	// (its home's filesystem is full): nothing was started.
	ErrStorage = errors.New("the shim cannot save the task's record; free space in its home")
	// ErrNotReady means the shim is still restoring tasks after a start.
	ErrNotReady = errors.New("the shim is restoring its tasks after a start; retry shortly")
)

// Labels put on every task container (dstack's, used for recovery).
const (
	LabelIsTask = "ai.dstack.shim.is-task"
	LabelTaskID = "ai.dstack.shim.task-id"
	// LabelShimHome names the shim (by its home) that created a container,
	// so that a shim adopts only its own strays. dstack's containers and
	// ours from before this label carry none: they are adopted when their
	// runner dir is under this shim's home, or with Config.AdoptUnlabelled
	// (decide.go, ownerOf).
	LabelShimHome = "run.tandem.shim.home"
)

// Paths inside the container (api/wire.go).
const (
	RunnerDirInContainer    = api.RunnerDirInContainer
	RunnerBinaryInContainer = api.RunnerBinaryInContainer
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

// Network is the bridge network that bridge-mode tasks join (shim/netiso):
// Ensure creates it when missing and returns its name.
type Network interface {
	Ensure(ctx context.Context) (string, error)
}

// Forwarder forwards a bridge task's container ports from the host.
type Forwarder interface {
	// Open forwards ports of the container at ip, on the host ports in
	// want where given, and returns the mappings.
	Open(taskID, ip string, ports []int, want []api.PortMapping) ([]api.PortMapping, error)
	// Close stops a task's forwards (a no-op when it has none).
	Close(taskID string)
}

// Config is how the engine runs tasks.
type Config struct {
	// Network isolates bridge-mode tasks from each other; nil: they join
	// Docker's default bridge, where containers reach each other.
	Network Network
	// Forwarder publishes a bridge task's runner ports on the host's
	// loopback behind the API's gate (shim/portfwd); nil: Docker publishes
	// them, to every local account.
	Forwarder Forwarder
	// RunnerAPIUIDs lists the local uids a host-network runner's API may
	// serve (the API's root-equivalent accounts); nil: the runner serves
	// every local client, as dstack's does.
	RunnerAPIUIDs func() []uint32
	// PidsLimit bounds each task's processes and threads (0: no bound), so
	// that a fork bomb in one task leaves the host's pids to the shim,
	// sshd and the other tasks; a Tandem client's task may ask for its own.
	PidsLimit int64
	// Observer receives metrics events (nil: none).
	Observer Observer
	// Volumes mounts network volumes; nil refuses tasks that ask for them.
	Volumes Volumes
	Home    string // shim home; runner dirs live in <home>/runners
	// AdoptUnlabelled takes every task container without a shim-home
	// label as this shim's (the migration from dstack's agents run with
	// another home); by default only those whose runner dir is under Home
	// are (recover.go, case 7).
	AdoptUnlabelled bool
	// RunnerDirs makes, re-attaches and removes the runner directories
	// (nil: plain directories; shim/runnerdir bounds each in a filesystem
	// of its own).
	RunnerDirs RunnerDirs
	// SpillDir keeps the task records the home's filesystem refuses until
	// they can be written home, across a restart (records); on another
	// filesystem. "": DefaultSpillDir(Home).
	SpillDir          string
	RunnerBinary      string // host path bind-mounted into every container
	RunnerHTTPPort    int
	RunnerSSHPort     int
	RunnerLogLevel    string
	RunnerSSHLogLevel string
	// RunnerArgs go after the runner's own `start` arguments (the job log
	// bounds the operator set; empty: the runner's defaults, which also
	// keeps dstack's own runner working under this shim).
	RunnerArgs       []string
	Env              []string // pass-env values and PJRT_DEVICE, as NAME=value
	Privileged       bool
	VolumesRoot      string // where network volumes are mounted
	InfinibandPath   string // "/dev/infiniband"; passed through when it exists
	PullStallTimeout time.Duration
	PullTimeout      time.Duration
	// TerminateWait bounds how long terminate waits for the pipeline to wind
	// down after the container stopped or a pre-run stage was cancelled.
	TerminateWait time.Duration
	// GPUVendor is the host's GPU vendor; NvidiaCDI selects CDI device
	// requests instead of the NVIDIA runtime hook. Unset, the engine asks
	// the runtime on the first GPU task (nvidiaCDI).
	GPUVendor api.GPUVendor
	NvidiaCDI bool
	// GPUHostRoot is where GPU device nodes are found ("/"; --host-root).
	GPUHostRoot string
}

// Defaults are the engine's defaults: WithDefaults (and so New) fills the
// zero fields of a Config from them, and the shim's flags show and use the
// same values.
func Defaults() Config {
	return Config{
		TerminateWait:    30 * time.Second,
		PullStallTimeout: 2 * time.Minute,
		PullTimeout:      2 * time.Hour,
		VolumesRoot:      "/mnt/disks/dstack-volumes",
		InfinibandPath:   "/dev/infiniband",
		RunnerBinary:     "/usr/local/bin/dstack-runner",
		RunnerHTTPPort:   api.RunnerHTTPPort,
		RunnerSSHPort:    api.RunnerSSHPort,
		RunnerLogLevel:   "info",
	}
}

// WithDefaults returns c with its zero fields taken from Defaults, but
// PullTimeout, whose zero means no cap.
func (c Config) WithDefaults() Config {
	d := Defaults()
	c.TerminateWait = cmp.Or(c.TerminateWait, d.TerminateWait)
	c.PullStallTimeout = cmp.Or(c.PullStallTimeout, d.PullStallTimeout)
	c.VolumesRoot = cmp.Or(c.VolumesRoot, d.VolumesRoot)
	c.InfinibandPath = cmp.Or(c.InfinibandPath, d.InfinibandPath)
	c.RunnerBinary = cmp.Or(c.RunnerBinary, d.RunnerBinary)
	c.RunnerHTTPPort = cmp.Or(c.RunnerHTTPPort, d.RunnerHTTPPort)
	c.RunnerSSHPort = cmp.Or(c.RunnerSSHPort, d.RunnerSSHPort)
	c.RunnerLogLevel = cmp.Or(c.RunnerLogLevel, d.RunnerLogLevel)
	return c
}

// Engine runs tasks.
type Engine struct {
	cfg  Config
	rt   Runtime
	gpus *gpu.Locks
	keys KeyEditor
	log  *slog.Logger
	now  func() time.Time

	// life ends when the shim shuts down (Shutdown): watchers stop waiting
	// on containers, which keep running.
	life     context.Context
	shutdown context.CancelFunc

	// mu guards the table only: tasks and tombstones. Each task's state is
	// guarded by its own lock (task.mu). Lock order: task.op, task.saveMu,
	// Engine.mu, task.mu; neither mu is held across a Docker call or a
	// disk write.
	mu         sync.RWMutex
	tasks      map[string]*task
	tombstones map[string]time.Time // removed ids (tombstone.go)
	wg         sync.WaitGroup       // pipelines
	stops      sync.WaitGroup       // terminates, which outlive a caller that left (stop.go)
	recs       *records             // nil: tasks are not persisted
	writers    writerCount          // background record writers (persist.go)
	resources  []resource           // host resources in acquire order (resource.go)
	// retries are the failed releases being retried (pipeline.go);
	// releaseBackoff is their first wait (0: releaseRetryFirst; tests).
	retries        sync.WaitGroup
	releaseBackoff time.Duration

	foreign foreignHolds // GPUs other agents' running containers use (recover.go)

	gpuModeMu sync.Mutex // guards gpuMode
	gpuMode   string     // the runtime's answer to GPUMode, once it gave one
}

// task is one task. The fields above mu are set when the task is made and
// never change; mu guards the rest. op serializes terminate and remove of
// this task (they wait, never crash, on each other). Status moves only
// through Engine.transition.
type task struct {
	op opLock

	cfg       api.TaskConfig
	submitted time.Time // when Submit accepted it (zero for restored tasks)
	created   time.Time // when Submit accepted it, kept across restarts
	pwHash    string    // hashPassword of the registry password (records keep only this)
	name      string    // container name
	tracker   *pull.Tracker
	cancelPre context.CancelFunc // aborts stages before running
	done      chan struct{}      // closed when nothing more runs for the task (markDone)
	// recordTook is how long Submit's first record write took (fsync
	// included), for the start's timing line; set before the pipeline runs.
	recordTook time.Duration

	mu      sync.Mutex
	status  api.TaskStatus
	reason  api.TerminationReason
	message string
	// held is what it holds, each kind of its list its own part
	// (resource.go), as its record keeps it; Container.Name is task.name.
	held       held
	hostKeys   []string                  // the runner's SSH host keys, once read
	keysLooked time.Time                 // when a GET last looked for them (query.go)
	keysLooks  int                       // plain GETs' looks so far (keysSpacing)
	stopReq    *api.TaskTerminateRequest // set by terminate
	job        *api.JobStateEvent        // the job's final state, once its runner left it
	jobLooked  time.Time                 // when a GET last looked for it (jobLookEvery)
	released   bool                      // every resource it held given back (resource.go)
	// releasing: a release (or its retries) runs; holding: the kinds
	// whose release failed, persisted, retried until given back.
	releasing bool
	holding   []string
	watched   bool // a goroutine waits for its container
	// probing: restored from a record before running; Docker has not yet
	// said whether its container started (recovery case 2).
	probing bool
	dirty   bool // a newer state awaits writing
	writing bool // a background writer runs
	removed bool // Remove forgot it: no record is written again
	// network is the bridge network the container joins when it is not
	// Docker's default (networkResource); not persisted.
	network string

	saveMu sync.Mutex // serializes this task's record writes (lock order: op, saveMu, Engine.mu, mu)

	doneOnce sync.Once // markDone closes done once, whichever path ends the task

	// settled is closed once a submit's answer has nothing to wait for
	// (AwaitSettled): the task runs, ended, or waits on a registry.
	settled     chan struct{}
	settledOnce sync.Once
}

// markSettled closes settled once. Safe to call twice, and on a task
// built without the channel (restored ones: nobody awaits them).
func (t *task) markSettled() {
	if t.settled == nil {
		return
	}
	t.settledOnce.Do(func() { close(t.settled) })
}

// markDone says nothing more runs for the task (its pipeline or watcher
// returned, or recovery settled it): terminate and remove wait on done.
// Safe to call twice.
func (t *task) markDone() {
	t.doneOnce.Do(func() { close(t.done) })
	t.markSettled()
}

// RunnerDirs makes, re-attaches (after a reboot) and removes the runner
// directories.
type RunnerDirs interface {
	Make(ctx context.Context, dir string) error
	Attach(dir string) error
	Remove(dir string) error
}

// New returns an engine. gpus may hold no GPUs; keys may be nil when no
// task asks for host keys.
func New(cfg Config, rt Runtime, gpus *gpu.Locks, keys KeyEditor, log *slog.Logger) *Engine {
	cfg = cfg.WithDefaults()
	if cfg.RunnerDirs == nil {
		cfg.RunnerDirs = &runnerdir.Dirs{} // plain directories
	}
	e := &Engine{cfg: cfg, rt: rt, gpus: gpus, keys: keys, log: log, now: time.Now, tasks: map[string]*task{}}
	e.life, e.shutdown = context.WithCancel(context.Background())
	e.writers.idle.L = &e.writers.mu
	e.resources = newResources(e)
	if cfg.Home != "" {
		e.recs = &records{dir: filepath.Join(cfg.Home, "tasks"), spill: cmp.Or(cfg.SpillDir, DefaultSpillDir(cfg.Home)), now: time.Now,
			reserve: &reserve{path: filepath.Join(cfg.Home, ".state-reserve"), size: defaultReserve, log: log}}
	}
	return e
}

// ContainerName is dstack's deterministic name: <name>-<8 hex of sha256(name/id)>.
func ContainerName(name, id string) string {
	sum := sha256.Sum256([]byte(name + "/" + id))
	return name + "-" + hex.EncodeToString(sum[:])[:8]
}

// Submit stores the task as pending and starts its pipeline. Re-submitting
// the same config under the same id is idempotent; a different one conflicts.
func (e *Engine) Submit(cfg api.TaskConfig) (api.TaskInfoResponse, error) {
	if err := validate(cfg); err != nil {
		return api.TaskInfoResponse{}, err
	}
	if err := validatePublish(cfg, e.runnerPorts()); err != nil {
		return api.TaskInfoResponse{}, err
	}
	if err := checkMountSources(cfg.InstanceMounts); err != nil {
		return api.TaskInfoResponse{}, err
	}
	cfg = normalize(cfg)
	e.mu.Lock()
	if t, ok := e.tasks[cfg.ID]; ok {
		e.mu.Unlock()
		same := sameSubmit(t, cfg)
		info := e.info(t)
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
		submitted: e.now(),
		status:    api.TaskPending,
		created:   e.now(),
		name:      ContainerName(cfg.Name, cfg.ID),
		tracker:   pull.NewTracker(e.now),
		cancelPre: cancel,
		done:      make(chan struct{}),
		settled:   make(chan struct{}),

		// The pipeline has not reached create: Docker holds nothing of it.
		held: held{Container: heldContainer{None: true}},
	}
	e.tasks[cfg.ID] = t
	e.wg.Add(1)
	e.mu.Unlock()
	info := e.info(t)
	forget := func() {
		e.mu.Lock()
		delete(e.tasks, cfg.ID)
		e.mu.Unlock()
		cancel()
		t.markSettled() // a submit awaiting it answers at once
		e.wg.Done()
	}
	// Its runner dir's room is taken first: with none, nothing is written.
	unreserve, err := e.reserveRunnerDir(t)
	if err != nil {
		forget()
		e.log.Warn("task refused: no room for its runner dir", "task_id", cfg.ID, "err", err)
		return api.TaskInfoResponse{}, err
	}
	// The first record is on disk before the answer: a task the server was
	// told about survives a restart. When it cannot be written, nothing
	// starts and the caller hears why.
	saveStart := e.now()
	err = e.save(t)
	t.recordTook = e.now().Sub(saveStart)
	if err != nil {
		unreserve()
		forget()
		_ = e.recs.remove(cfg.ID) // the copy spilled while it failed: a refused task is not restored
		e.log.Error("task refused: its record cannot be written", "task_id", cfg.ID, "err", err)
		return api.TaskInfoResponse{}, fmt.Errorf("%w: %v", ErrStorage, err)
	}
	e.obs().TaskSubmitted()
	go func() {
		defer e.wg.Done()
		defer unreserve() // its image, once made, counts from the disk
		e.run(ctx, t)
	}()
	return info, nil
}

// nvidiaCDI says whether NVIDIA GPUs are requested as CDI devices: when
// configured so, or as the runtime answers on the first GPU task (kept once
// it answered; a runtime that cannot tell means the hook, and is asked
// again next time). Nothing outside the engine changes it after start.
func (e *Engine) nvidiaCDI() bool {
	if e.cfg.GPUVendor != api.GPUVendorNVIDIA {
		return false
	}
	if e.cfg.NvidiaCDI {
		return true
	}
	e.gpuModeMu.Lock()
	defer e.gpuModeMu.Unlock()
	if e.gpuMode == "" {
		ctx, cancel := context.WithTimeout(e.life, dockerCallTimeout)
		mode, err := e.rt.GPUMode(ctx)
		cancel()
		switch {
		case err != nil:
			e.log.Warn("cannot tell how Docker reaches NVIDIA GPUs; assuming the runtime hook", "err", err)
			return false
		case mode == "":
			e.log.Warn("Docker has neither the NVIDIA runtime nor CDI; GPU tasks fail to start until nvidia-container-toolkit is set up")
			return false
		}
		e.gpuMode = mode
		e.log.Info("NVIDIA GPUs reached via " + mode)
	}
	return e.gpuMode == "cdi"
}

// LearnGPUAccess asks the runtime now how it reaches NVIDIA GPUs, instead
// of on the first GPU task: the agent calls it once Docker answers, so that
// the shim's log says at start whether GPU tasks can start. A runtime that
// cannot tell is asked again on the first GPU task. It says whether GPUs
// are requested as CDI devices.
func (e *Engine) LearnGPUAccess() bool { return e.nvidiaCDI() }

// Shutdown stops watching containers (they keep running; a restarted shim
// re-attaches). Idempotent.
func (e *Engine) Shutdown() { e.shutdown() }

// Wait blocks until every pipeline has returned (for tests and shutdown of
// tests; the shim itself never stops containers on exit).
func (e *Engine) Wait() { e.stops.Wait(); e.wg.Wait(); e.retries.Wait() }
