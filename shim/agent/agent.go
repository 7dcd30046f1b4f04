// Package agent wires dstack-shim together: logging, components, Docker, the
// task engine and the HTTP server, in the start-up order dstack's shim uses.
package agent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/lifecycle"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/common/procs"
	"github.com/tandem-run/tandem/common/version"
	"github.com/tandem-run/tandem/shim/authkeys"
	"github.com/tandem-run/tandem/shim/component"
	"github.com/tandem-run/tandem/shim/dockerrt"
	"github.com/tandem-run/tandem/shim/fastpull"
	"github.com/tandem-run/tandem/shim/gpu"
	"github.com/tandem-run/tandem/shim/imagegc"
	"github.com/tandem-run/tandem/shim/metrics"
	"github.com/tandem-run/tandem/shim/netiso"
	"github.com/tandem-run/tandem/shim/portfwd"
	"github.com/tandem-run/tandem/shim/principal"
	"github.com/tandem-run/tandem/shim/runnerdir"
	"github.com/tandem-run/tandem/shim/task"
	"github.com/tandem-run/tandem/shim/volume"
)

// Config is the shim's configuration, from flags and environment.
type Config struct {
	Home        string
	BinaryPath  string
	HTTPAddress string
	HTTPPort    int
	// APIAllowContainers, APIToken and APIAllowedHosts configure who may
	// call the API (server.Access).
	APIAllowContainers bool
	// Nice is the CPU priority the shim gives itself at start when it was
	// started at the default (procs.Prioritize); 0 leaves it.
	Nice int
	// KeepStartupMemory turns off memtrim after recovery (a kill switch).
	KeepStartupMemory bool
	APIToken          string
	APIAllowedHosts   []string
	// APIAllowUsers admits more local accounts than the root-equivalent
	// ones (principal.Policy.Allow: uids, user names, @groups).
	APIAllowUsers []string
	// RunnerDirSize bounds each task's runner directory in a filesystem of
	// its own (--runner-dir-size; ≤ 0: plain, unbounded directories).
	RunnerDirSize int64
	// PidsLimit bounds each task's processes and threads (--pids-limit):
	// 0 picks a default from the kernel's pid_max, -1 none.
	PidsLimit int64
	// MetricsAddress, when set, serves GET /metrics alone on its own
	// listener, to any scraper (a Prometheus in a container, on another
	// machine, or as its own account), without opening the task API.
	MetricsAddress string
	// DockerPublishesPorts leaves a bridge task's runner ports to Docker's
	// publishing (reachable by every local account) instead of the shim's
	// gated forwards: a kill switch.
	DockerPublishesPorts bool
	// HostRoot is where the host's files are read ("/"): AMD GPUs' sysfs
	// and the account files (passwd, group, sudoers); the binary runs
	// against a fixture tree with --host-root, as node_exporter's
	// --path.rootfs.
	HostRoot string
	// PolicyRoot is where the account files are read (HostRoot when
	// empty); a test points it at a fixture tree.
	PolicyRoot string
	// ReconcileInterval is the reconcile loop's period (5 s).
	ReconcileInterval time.Duration
	// SubmitWait bounds how long a submit's answer waits for its task to
	// run (--submit-wait; 0: at once, as dstack's shim answers).
	SubmitWait        time.Duration
	LogLevel          slog.Level
	LogFormat         logging.Format
	RunnerDownloadURL string
	ServiceMode       bool
	DCGMExporterPort  int
	// GPUMetricsInterval is how often GPU metrics are sampled or fetched
	// (--dcgm-exporter-interval; default 5 s).
	GPUMetricsInterval time.Duration
	GCPDiskByID        string // "/dev/disk/by-id"
	// Task is the task engine's configuration as the flags set it (runner
	// binary and ports, pulls, volumes root, env, runner arguments); Run
	// adds what only it knows (home, network, volumes, GPU vendor) to its
	// own copy. Zero fields take task.Defaults().
	Task task.Config
	// FastPull is the fast image pull (shim/fastpull): ranged parallel
	// fetch, served to Docker's pull by a loopback registry; Docker's pull
	// from upstream behind it.
	// Its zero value is off; Defaults has it on (fastpull.Config says why).
	FastPull fastpull.Config
	// ImageGC frees Docker's disk past its thresholds (nil: off), every
	// ImageGCInterval.
	ImageGC         *imagegc.Policy
	ImageGCInterval time.Duration
	// IsolatedNetwork is the bridge network (no inter-container traffic)
	// that bridge-mode tasks join; "": Docker's default bridge.
	IsolatedNetwork string
	// Ready, if set, receives the listen address once the API serves.
	Ready func(addr string)
}

// Defaults are the agent's defaults: the flags show and use them, and Run
// fills a zero field from them (WithDefaults).
func Defaults() Config {
	return Config{
		ReconcileInterval:  5 * time.Second,
		GPUMetricsInterval: 5 * time.Second,
		GCPDiskByID:        "/dev/disk/by-id",
		HostRoot:           "/",
		RunnerDirSize:      runnerdir.DefaultSize,
		Nice:               DefaultNice,
		SubmitWait:         DefaultSubmitWait,
		FastPull:           fastpull.Defaults(),
	}
}

// DefaultSubmitWait is well under the 9 s that dstack's server gives a
// shim request (REQUEST_TIMEOUT), SSH tunnel included, and above a warm
// start on a loaded host (~0.3 s) many times over.
const DefaultSubmitWait = 3 * time.Second

// DefaultNice puts the shim's few CPU-seconds ahead of the Docker engine's
// and the jobs' (see procs.Prioritize for what it measured).
const DefaultNice = -10

// WithDefaults returns c with its zero intervals and paths from Defaults
// (not RunnerDirSize, whose 0 means plain directories).
func (c Config) WithDefaults() Config {
	d := Defaults()
	c.ReconcileInterval = cmp.Or(c.ReconcileInterval, d.ReconcileInterval)
	if c.GPUMetricsInterval <= 0 {
		c.GPUMetricsInterval = d.GPUMetricsInterval
	}
	c.GCPDiskByID = cmp.Or(c.GCPDiskByID, d.GCPDiskByID)
	c.HostRoot = cmp.Or(c.HostRoot, d.HostRoot)
	c.PolicyRoot = cmp.Or(c.PolicyRoot, c.HostRoot)
	return c
}

// Run runs the shim until ctx ends or an API shutdown; running containers
// are never stopped on exit. Its parts start in order, each from what the
// ones before made, and stop in reverse (lifecycle.Stack).
func Run(ctx context.Context, cfg Config) error {
	cfg = cfg.WithDefaults()
	a := &agent{cfg: cfg, tcfg: cfg.Task.WithDefaults()}
	defer a.Stop()
	if err := a.Start(ctx,
		lifecycle.Step{Name: "log", Start: a.startLog},
		lifecycle.Step{Name: "components", Start: a.startComponents},
		lifecycle.Step{Name: "docker", Start: a.startDocker},
		lifecycle.Step{Name: "gpus", Start: a.startGPUs},
		lifecycle.Step{Name: "engine", Start: a.startEngine},
		lifecycle.Step{Name: "recovery", Start: a.startRecovery},
		lifecycle.Step{Name: "api", Start: a.startAPI},
		lifecycle.Step{Name: "systemd", Start: a.startSystemd},
	); err != nil {
		return err
	}
	return a.wait(ctx)
}

// agent is the running shim. Its fields are set by the start steps, in
// order; OnStop registers what undoes each.
type agent struct {
	cfg Config
	// ledger: imageLedger's, made once.
	ledger     *imagegc.Ledger
	ledgerOnce sync.Once
	tcfg       task.Config // the engine's, with what only the agent knows added
	log        *slog.Logger

	runnerComp, shimComp *component.Manager
	rt                   *dockerrt.Runtime
	nvml                 *gpu.NVML
	gpus                 []gpu.GPU
	locks                *gpu.Locks
	vendor               api.GPUVendor
	mx                   *metrics.Metrics
	engine               *task.Engine
	ready                chan struct{} // closed once recovery is done
	dockerRoot           string        // Docker's data root, known once recovery is done
	ln                   net.Listener
	hs                   *http.Server
	serveErr             chan error // Serve's return; served says wait took it
	served               bool
	sd                   *shutdown
	force                bool // the API asked for a forced shutdown
	policy               *principal.Policy

	lifecycle.Stack // what started, stopped in reverse by Run
}

func (a *agent) startLog(context.Context) error {
	log, logFile, err := logging.ToFile(a.cfg.LogLevel, a.cfg.LogFormat, os.Stderr, filepath.Join(a.cfg.Home, "shim.log"))
	if err != nil {
		return err
	}
	a.log = log
	a.OnStop(func() { logFile.Close() })
	log.Info("dstack-shim starting", "version", version.String(), "tandem_version", version.Tandem(), "home", a.cfg.Home)
	if a.cfg.Nice != 0 {
		now, err := procs.Prioritize(a.cfg.Nice)
		switch {
		case err != nil:
			log.Warn("cannot set the shim's CPU priority: its API may answer late while the host's CPUs are busy", "nice", now, "wanted", a.cfg.Nice, "err", err)
		case now != a.cfg.Nice:
			log.Info("the shim keeps the CPU priority it was started with", "nice", now)
		default:
			log.Debug("CPU priority set", "nice", now)
		}
	}
	return nil
}

// startComponents checks (and with a download URL installs) the runner and
// the shim binaries.
func (a *agent) startComponents(ctx context.Context) error {
	// The runner's version is kept in the home, so a restart (the server's
	// updates, dstack's restart loop) does not run an unchanged binary.
	a.runnerComp = &component.Manager{Name: api.ComponentRunner, Path: a.tcfg.RunnerBinary, Log: a.log,
		VersionCache: filepath.Join(a.cfg.Home, "runner-version.json")}
	a.shimComp = &component.Manager{Name: api.ComponentShim, Path: a.cfg.BinaryPath, Log: a.log}
	if a.cfg.RunnerDownloadURL != "" {
		if err := a.runnerComp.EnsureInstalled(ctx, a.cfg.RunnerDownloadURL); err != nil {
			return fmt.Errorf("install runner: %w", err)
		}
	}
	if info := a.runnerComp.Info(ctx); info.Status == api.ComponentError {
		return fmt.Errorf("runner binary %s does not answer `--version` as dstack-runner", a.tcfg.RunnerBinary)
	} else if info.Status == api.ComponentNotInstalled {
		// The API still serves (the dstack server installs a runner through
		// it), but every task fails until there is one: said at the start,
		// with the fix, not first by a task's Docker error.
		a.log.Warn("no runner binary: every task fails until there is one; start the shim with --runner-binary-path PATH (a build's bin/dstack-runner), or install one (POST /api/components/install)", "path", a.tcfg.RunnerBinary)
	}
	// The shim binary is normally this process's own file: no need to run
	// it to learn the version this process is.
	a.shimComp.Running("/proc/self/exe", version.String())
	if info := a.shimComp.Info(ctx); info.Status == api.ComponentError {
		return fmt.Errorf("shim binary %s does not answer `--version` as dstack-shim", a.cfg.BinaryPath)
	}
	return nil
}

// startDocker makes the Docker client. A daemon that is down does not stop
// the shim from serving: the API stays up and tasks report Docker's error
// (dstack restart-loops here).
func (a *agent) startDocker(context.Context) error {
	rt, err := dockerrt.New()
	if err != nil {
		return err
	}
	a.rt = rt
	a.OnStop(func() { rt.Close() })
	return nil
}

// startGPUs asks every vendor for GPUs (in dstack's order: the vendors
// with device paths of their own first); discrete GPUs of two vendors stop
// the shim with a clear error instead of a silent pick.
func (a *agent) startGPUs(ctx context.Context) error {
	a.nvml = gpu.NewNVML()
	root := a.cfg.HostRoot
	a.tcfg.GPUHostRoot = root
	gpus, err := gpu.Discover(ctx, a.log, a.nvml, gpu.Tenstorrent{Root: root}, gpu.AMD{Root: root},
		gpu.Gaudi{Root: root, Log: a.log})
	if err != nil {
		return err
	}
	a.gpus, a.locks = gpus, gpu.NewLocksFor(gpus)
	if len(gpus) > 0 {
		a.vendor = gpus[0].Vendor
	}
	return nil
}

// startEngine builds the task engine from everything it uses; nothing
// changes it afterwards. Its stop ends the watchers (containers keep
// running) and waits for the records to be on disk.
func (a *agent) startEngine(context.Context) error {
	volumes := &volume.Manager{
		Root: a.tcfg.VolumesRoot,
		Resolvers: map[string]volume.Resolver{
			"aws": volume.AWS{List: volume.Lsblk},
			"gcp": volume.GCP{ByID: a.cfg.GCPDiskByID},
		},
		Log: a.log,
	}
	a.mx = metrics.New()
	volumes.Observe = a.mx.VolumeMount
	a.runnerComp.Observe, a.shimComp.Observe = a.mx.ComponentInstalled, a.mx.ComponentInstalled
	var taskNet task.Network
	if a.cfg.IsolatedNetwork != "" {
		taskNet = &netiso.Network{Name: a.cfg.IsolatedNetwork, Docker: a.rt.Client(), Log: a.log}
	}
	a.tcfg.Network, a.tcfg.Observer, a.tcfg.Volumes, a.tcfg.Home, a.tcfg.GPUVendor = taskNet, a.mx, volumes, a.cfg.Home, a.vendor
	if !a.cfg.DockerPublishesPorts {
		fwd := portfwd.New(a.access().AdmitConn, a.log)
		a.tcfg.Forwarder = fwd
		a.OnStop(fwd.CloseAll)
	} else {
		a.log.Warn("Docker publishes bridge tasks' runner ports: every local account can reach them (--docker-publish-ports)")
	}
	a.tcfg.RunnerAPIUIDs = a.principals().AllowedUIDs
	a.tcfg.PidsLimit = pidsLimit(a.cfg.PidsLimit)
	warnEphemeralPorts(a.log, filepath.Join(a.cfg.HostRoot, "proc/sys/net/ipv4/ip_local_port_range"),
		map[string]int{"runner-http-port": a.tcfg.RunnerHTTPPort, "runner-ssh-port": a.tcfg.RunnerSSHPort})
	dirs := a.runnerDirs()
	a.tcfg.RunnerDirs = dirs
	dirs.Warm(filepath.Join(a.cfg.Home, "runners"))
	a.OnStop(dirs.Close)
	a.log.Info("each task's processes and threads are bounded", "pids_limit", a.tcfg.PidsLimit)
	a.engine = task.New(a.tcfg, a.pullRuntime(), a.locks, &authkeys.Editor{}, a.log)
	a.OnStop(func() {
		a.engine.Shutdown()
		a.engine.Sync() // records on disk before the process goes
		a.log.Info("dstack-shim stopped; containers keep running")
	})
	return nil
}

// pullRuntime is the engine's runtime: Docker, its pulls through the fast
// path when that is on (its temporary dir under the shim's home).
func (a *agent) pullRuntime() task.Runtime {
	fc := a.cfg.FastPull
	if !fc.Enabled {
		return a.rt
	}
	fc.TempDir = cmp.Or(fc.TempDir, filepath.Join(a.cfg.Home, "image-pull"))
	if err := os.MkdirAll(fc.TempDir, 0o700); err != nil {
		a.log.Warn("fast image pull off: no temporary dir", "dir", fc.TempDir, "err", err)
		return a.rt
	}
	fc.Loaded = a.imageLedger().Add
	fc.Admit = a.access().AdmitRegistryConn
	a.log.Info("image pulls take the fast path first", "temp_dir", fc.TempDir, "conns", fc.WithDefaults().Conns)
	return fastpull.Runtime{Runtime: a.rt, Puller: fastpull.New(fc, a.rt.Client(), a.log), Forget: a.rt.ForgetImage}
}

// startRecovery restores the tasks in the background, once Docker answers
// its facts, then reconciles on every tick. The API serves before anything
// waits on Docker: a hung daemon must not make the instance look dead.
// Task calls wait (bounded) for recovery and answer 503 past it; the server
// retries.
func (a *agent) startRecovery(ctx context.Context) error {
	a.ready = make(chan struct{})
	ctx, cancel := context.WithCancel(ctx)
	// Its stop ends recovery and waits for it: nothing of it writes into
	// the home (the state reserve, host_info.json) after the shim stopped.
	a.OnStop(func() {
		cancel()
		<-a.ready
	})
	go func() {
		defer close(a.ready)
		diskPath, cdiDirs, answered := dockerFacts(ctx, a.rt, a.log)
		if answered {
			a.dockerRoot = diskPath
		}
		// Logs how Docker reaches the GPUs, or why it cannot; through CDI,
		// whether its specs name them.
		if answered && a.vendor == api.GPUVendorNVIDIA && a.engine.LearnGPUAccess() {
			checkCDISpecs(a.log, cdiDirs, a.gpus)
		}
		if a.cfg.ServiceMode {
			writeHostInfo(a.cfg.Home, a.gpus, diskPath, a.log)
		}
		// Restart safety: tasks come back from their records, re-attached to
		// their containers; what Docker cannot answer for now is settled by
		// the reconcile loop once it does.
		if err := a.engine.Restore(ctx); err != nil {
			a.log.Warn("restoring tasks is incomplete until Docker answers", "err", err)
		}
	}()
	go func() {
		select {
		case <-a.ready:
			a.startImageGC(ctx)
			a.engine.ReconcileLoop(ctx, a.cfg.ReconcileInterval)
		case <-ctx.Done():
		}
	}()
	return nil
}

// startImageGC runs image GC on Docker's data root in the background,
// when it is on and Docker said where that is.
// imageLedger is the shim's record of the images it loaded into Docker
// itself, which its image GC may remove beside pulled ones.
func (a *agent) imageLedger() *imagegc.Ledger {
	a.ledgerOnce.Do(func() { a.ledger = &imagegc.Ledger{Path: filepath.Join(a.cfg.Home, "images-loaded")} })
	return a.ledger
}

func (a *agent) startImageGC(ctx context.Context) {
	if a.cfg.ImageGC == nil {
		return
	}
	if a.dockerRoot == "" {
		a.log.Warn("image GC is off: Docker did not say where its data root is")
		return
	}
	gc := &imagegc.Collector{Policy: *a.cfg.ImageGC, Disk: imagegc.Statfs{}, Engine: imagegc.Docker{API: a.rt.Client()},
		Path: a.dockerRoot, Tasks: a.engine.ImageNames, Ours: a.imageLedger().IDs, Log: a.log}
	every := cmp.Or(a.cfg.ImageGCInterval, time.Minute)
	a.log.Info("image GC", "path", a.dockerRoot, "high_percent", gc.Policy.HighPercent, "low_percent", gc.Policy.LowPercent, "kept", gc.Policy.Keep, "every", every)
	t := time.NewTicker(every)
	go func() {
		defer t.Stop()
		gc.Run(ctx, t.C)
	}()
}

// pidsLimit is the flag's value: 0 picks DefaultPidsLimit for this
// kernel's pid_max, -1 none.
func pidsLimit(flag int64) int64 {
	switch {
	case flag < 0:
		return 0
	case flag > 0:
		return flag
	}
	pidMax := int64(32768)
	if b, err := os.ReadFile("/proc/sys/kernel/pid_max"); err == nil {
		if v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err == nil && v > 0 {
			pidMax = v
		}
	}
	return task.DefaultPidsLimit(pidMax)
}

// dockerSocket is the Docker daemon's unix socket as DOCKER_HOST names it
// ("" when unset: the default one); local is false when DOCKER_HOST names
// another transport (tcp, ssh).
func dockerSocket() (path string, local bool) {
	h := os.Getenv("DOCKER_HOST")
	if h == "" {
		return "", true
	}
	if path, local = strings.CutPrefix(h, "unix://"); !local {
		return "", false
	}
	return path, true
}

// runnerDirs bounds each task's runner dir in a filesystem of its own,
// where the Docker daemon sees the shim's mounts.
func (a *agent) runnerDirs() *runnerdir.Dirs {
	size := a.cfg.RunnerDirSize
	if size > 0 {
		err := errors.New("the Docker daemon is not on a local unix socket")
		if sock, local := dockerSocket(); local {
			err = runnerdir.SharesMounts(sock)
		}
		if err != nil {
			a.log.Warn("runner dirs are plain directories: the Docker daemon would not see their mounts", "err", err)
			size = 0
		}
	}
	if size > 0 {
		a.log.Info("each task's runner dir is a filesystem of its own", "size_bytes", size)
	} else if a.cfg.RunnerDirSize <= 0 {
		a.log.Warn("runner dirs are plain directories: a job can fill the shim home's disk through its own (--runner-dir-size)")
	}
	return &runnerdir.Dirs{Size: size, Log: a.log}
}
