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

	"golang.org/x/net/netutil"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/httpapi"
	"github.com/tandem-run/tandem/common/lifecycle"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/common/memtrim"
	"github.com/tandem-run/tandem/common/sdnotify"
	"github.com/tandem-run/tandem/common/version"
	"github.com/tandem-run/tandem/shim/authkeys"
	"github.com/tandem-run/tandem/shim/component"
	"github.com/tandem-run/tandem/shim/dockerrt"
	"github.com/tandem-run/tandem/shim/gpu"
	"github.com/tandem-run/tandem/shim/hostinfo"
	"github.com/tandem-run/tandem/shim/metrics"
	"github.com/tandem-run/tandem/shim/netiso"
	"github.com/tandem-run/tandem/shim/origin"
	"github.com/tandem-run/tandem/shim/portfwd"
	"github.com/tandem-run/tandem/shim/principal"
	"github.com/tandem-run/tandem/shim/runnerdir"
	"github.com/tandem-run/tandem/shim/server"
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
	}
}

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
	steps := []struct {
		name  string
		start func(context.Context) error
	}{
		{"log", a.startLog},
		{"components", a.startComponents},
		{"docker", a.startDocker},
		{"gpus", a.startGPUs},
		{"engine", a.startEngine},
		{"recovery", a.startRecovery},
		{"api", a.startAPI},
		{"systemd", a.startSystemd},
	}
	for _, st := range steps {
		if err := st.start(ctx); err != nil {
			return err
		}
	}
	return a.wait(ctx)
}

// agent is the running shim. Its fields are set by the start steps, in
// order; OnStop registers what undoes each.
type agent struct {
	cfg  Config
	tcfg task.Config // the engine's, with what only the agent knows added
	log  *slog.Logger

	runnerComp, shimComp *component.Manager
	rt                   *dockerrt.Runtime
	nvml                 *gpu.NVML
	gpus                 []gpu.GPU
	locks                *gpu.Locks
	vendor               api.GPUVendor
	mx                   *metrics.Metrics
	engine               *task.Engine
	ready                chan struct{} // closed once recovery is done
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
	return nil
}

// startComponents checks (and with a download URL installs) the runner and
// the shim binaries.
func (a *agent) startComponents(ctx context.Context) error {
	a.runnerComp = &component.Manager{Name: api.ComponentRunner, Path: a.tcfg.RunnerBinary, Log: a.log}
	a.shimComp = &component.Manager{Name: api.ComponentShim, Path: a.cfg.BinaryPath, Log: a.log}
	if a.cfg.RunnerDownloadURL != "" {
		if err := a.runnerComp.EnsureInstalled(ctx, a.cfg.RunnerDownloadURL); err != nil {
			return fmt.Errorf("install runner: %w", err)
		}
	}
	if info := a.runnerComp.Info(ctx); info.Status == api.ComponentError {
		return fmt.Errorf("runner binary %s does not answer `--version` as dstack-runner", a.tcfg.RunnerBinary)
	} else if info.Status == api.ComponentNotInstalled {
		a.log.Warn("runner binary is missing; tasks will fail until it is installed", "path", a.tcfg.RunnerBinary)
	}
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

// startGPUs asks every vendor for GPUs; discrete GPUs of two vendors stop
// the shim with a clear error instead of a silent pick.
func (a *agent) startGPUs(ctx context.Context) error {
	a.nvml = gpu.NewNVML()
	gpus, err := gpu.Discover(ctx, a.log, a.nvml, gpu.AMD{Root: a.cfg.HostRoot})
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
	dirs := a.runnerDirs()
	a.tcfg.RunnerDirs = dirs
	dirs.Warm(filepath.Join(a.cfg.Home, "runners"))
	a.OnStop(dirs.Close)
	a.log.Info("each task's processes and threads are bounded", "pids_limit", a.tcfg.PidsLimit)
	a.engine = task.New(a.tcfg, a.rt, a.locks, &authkeys.Editor{}, a.log)
	a.OnStop(func() {
		a.engine.Shutdown()
		a.engine.Sync() // records on disk before the process goes
		a.log.Info("dstack-shim stopped; containers keep running")
	})
	return nil
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
		diskPath, answered := dockerFacts(ctx, a.rt, a.log)
		if answered && a.vendor == api.GPUVendorNVIDIA {
			a.engine.LearnGPUAccess() // logs how Docker reaches the GPUs, or why it cannot
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
			a.engine.ReconcileLoop(ctx, a.cfg.ReconcileInterval)
		case <-ctx.Done():
		}
	}()
	return nil
}

// startAPI serves the shim API. Its stop cancels component installs, then
// shuts the server down (at once when the API asked for force).
func (a *agent) startAPI(ctx context.Context) error {
	inst := hostInstance{gpus: a.gpus, health: instanceHealth{docker: a.rt.Ping}}
	var gpuMetrics server.GPUMetrics
	if a.vendor == api.GPUVendorNVIDIA {
		xids := a.nvml.WatchXIDs(ctx)
		inst.health.gpus = func(context.Context) *api.DCGMHealth { return a.nvml.Health(xids()) }
		every := a.cfg.GPUMetricsInterval
		m := nvidiaMetrics{nvml: &gpu.Metrics{NVML: a.nvml, Interval: every}}
		if a.cfg.DCGMExporterPort > 0 {
			m.exporter = &gpu.Exporter{URL: fmt.Sprintf("http://localhost:%d/metrics", a.cfg.DCGMExporterPort), Interval: every}
		}
		gpuMetrics = m
	}
	installCtx, cancelInstalls := context.WithCancel(context.Background())
	a.sd = newShutdown()
	metricsH := a.mx.Handler(metrics.Sources{Tasks: a.engine, GPUs: a.locks})
	e := server.New(server.Deps{
		Version:           version.String(),
		TandemVersion:     version.Tandem(),
		Tasks:             a.engine,
		Runner:            a.runnerComp,
		Shim:              a.shimComp,
		InstallCtx:        installCtx,
		Instance:          inst,
		GPUMetrics:        gpuMetrics,
		Stopper:           a.sd,
		Readiness:         recovered{done: a.ready},
		Log:               a.log,
		Metrics:           metricsH,
		MetricsMiddleware: a.mx.Middleware(),
	})
	addr := net.JoinHostPort(a.cfg.HTTPAddress, strconv.Itoa(a.cfg.HTTPPort))
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		cancelInstalls()
		return fmt.Errorf("listen %s: %w", addr, err)
	}
	access := a.access()
	e.Pre(access.Middleware())
	if a.cfg.APIAllowContainers {
		a.log.Warn("the shim API serves callers inside containers too (--api-allow-containers)")
	}
	a.ln, a.hs = ln, httpapi.NewServer(e, httpapi.DefaultLimits)
	// Who a connection is, is decided when it is accepted, before it holds
	// one of the API's slots: a container's connections are refused at
	// once, and the reserve is for the host.
	gate := httpapi.NewGate(ln, httpapi.DefaultLimits, access.Admit(), a.log)
	gate.Attach(a.hs)
	a.serveErr = make(chan error, 1)
	go func() { a.serveErr <- a.hs.Serve(gate) }()
	a.OnStop(func() {
		cancelInstalls()
		if a.force {
			_ = a.hs.Close()
			return
		}
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := a.hs.Shutdown(sctx); err != nil {
			_ = a.hs.Close()
		}
		if !a.served {
			if err := <-a.serveErr; err != nil && !errors.Is(err, http.ErrServerClosed) {
				a.log.Error("serve", "err", err)
			}
		}
	})
	a.log.Info("shim API serving", "addr", gate.Addr().String())
	if a.cfg.MetricsAddress != "" {
		if err := a.startMetrics(metricsH); err != nil {
			return err
		}
	}
	if a.cfg.Ready != nil {
		a.cfg.Ready(gate.Addr().String())
	}
	return nil
}

// startMetrics serves h (the API's /metrics) alone on --metrics-address:
// read-only counters for a scraper anywhere. Each connection is bounded in
// time and there are at most 32 at once; nothing else of the API answers
// there.
func (a *agent) startMetrics(h http.Handler) error {
	ln, err := net.Listen("tcp", a.cfg.MetricsAddress)
	if err != nil {
		return fmt.Errorf("listen %s (--metrics-address): %w", a.cfg.MetricsAddress, err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", h)
	hs := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 10 * time.Second, WriteTimeout: 30 * time.Second,
		IdleTimeout: 60 * time.Second, MaxHeaderBytes: 16 << 10, ErrorLog: slog.NewLogLogger(a.log.Handler(), slog.LevelDebug)}
	go func() { _ = hs.Serve(netutil.LimitListener(ln, 32)) }()
	a.OnStop(func() { _ = hs.Close() })
	a.log.Info("metrics serving", "addr", ln.Addr().String())
	return nil
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

// runnerDirs bounds each task's runner dir in a filesystem of its own,
// where the Docker daemon sees the shim's mounts.
func (a *agent) runnerDirs() *runnerdir.Dirs {
	size := a.cfg.RunnerDirSize
	if size > 0 {
		sock, unixSock := "", true
		if h := os.Getenv("DOCKER_HOST"); h != "" {
			sock, unixSock = strings.CutPrefix(h, "unix://")
		}
		err := errors.New("the Docker daemon is not on a local unix socket")
		if unixSock {
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

// access is who may call the API and the forwarded task ports.
func (a *agent) access() server.Access {
	return server.Access{AllowContainers: a.cfg.APIAllowContainers, Token: a.cfg.APIToken, AllowedHosts: a.cfg.APIAllowedHosts,
		Check: origin.Checker{}.CheckBatch, Principals: a.principals(), Log: a.log}
}

// principals is who may drive the agents (the shim's API and the runner
// ports it forwards): root-equivalent accounts and the operator's list.
func (a *agent) principals() *principal.Policy {
	if a.policy == nil {
		sock := ""
		if h, ok := strings.CutPrefix(os.Getenv("DOCKER_HOST"), "unix://"); ok {
			sock = h
		}
		a.policy = &principal.Policy{Root: a.cfg.PolicyRoot, Allow: a.cfg.APIAllowUsers, DockerSocket: sock, Log: a.log}
		a.log.Info("API callers admitted", "rule", a.policy.String())
	}
	return a.policy
}

// startSystemd tells systemd (Type=notify) the shim is ready once it
// serves and recovered, then feeds the watchdog only while the API and the
// engine answer. Its stop says STOPPING=1.
func (a *agent) startSystemd(context.Context) error {
	notify := sdnotify.FromEnv()
	stopWatch := make(chan struct{})
	a.OnStop(func() {
		close(stopWatch)
		_ = notify.Send("STOPPING=1")
	})
	go func() {
		select {
		case <-a.ready:
		case <-stopWatch:
			return
		}
		// Start-up is over: its pages of the binary go back (see memtrim).
		if !a.cfg.KeepStartupMemory {
			if r, err := memtrim.Release(); err != nil {
				a.log.Warn("releasing start-up memory", "err", err)
			} else {
				a.log.Debug("released start-up memory", "executable_rss_before", r.Before, "after", r.After)
			}
		}
		if err := notify.Send("READY=1"); err != nil {
			a.log.Warn("systemd notify", "err", err)
		}
		every := sdnotify.WatchdogInterval() / 2
		if every <= 0 {
			return
		}
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-stopWatch:
				return
			case <-t.C:
				if alive(a.engine, a.ln.Addr().String(), every) {
					_ = notify.Send("WATCHDOG=1")
				} else {
					a.log.Error("watchdog: the shim is not answering itself; systemd will restart it")
				}
			}
		}
	}()
	return nil
}

// wait runs until the server fails, ctx ends or the API asks for a
// shutdown; Run then takes the parts down in reverse.
func (a *agent) wait(ctx context.Context) error {
	select {
	case err := <-a.serveErr:
		a.served = true
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
		a.log.Info("signal received, shutting down")
	case force := <-a.sd.ch:
		a.force = force
		a.log.Info("API shutdown requested", "force", force)
	}
	return nil
}

// shutdown delivers the first shutdown request; a later force one upgrades.
type shutdown struct {
	once sync.Once
	ch   chan bool
}

func newShutdown() *shutdown { return &shutdown{ch: make(chan bool, 1)} }

// Stop asks Run to stop (server.Stopper); the first request wins.
func (s *shutdown) Stop(force bool) {
	s.once.Do(func() { s.ch <- force })
}

// dockerFacts asks Docker, bounded, for its root dir (host_info's disk) and
// logs its version. A daemon that does not answer leaves "/", logged, and
// answered false.
func dockerFacts(ctx context.Context, rt *dockerrt.Runtime, log *slog.Logger) (diskPath string, answered bool) {
	ictx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	info, err := rt.Client().Info(ictx)
	if err != nil {
		log.Error("docker is not answering; tasks will fail until it does", "err", err)
		return "/", false
	}
	log.Info("docker", "server_version", info.ServerVersion, "root", info.DockerRootDir, "runtimes", len(info.Runtimes))
	return info.DockerRootDir, true
}

// writeHostInfo writes host_info.json once (service mode).
func writeHostInfo(home string, gpus []gpu.GPU, diskPath string, log *slog.Logger) {
	hi, err := hostinfo.Collect(gpus, diskPath)
	if err != nil {
		log.Error("collect host info", "err", err)
		return
	}
	if wrote, err := hostinfo.WriteOnce(filepath.Join(home, "host_info.json"), hi); err != nil {
		log.Error("write host_info.json", "err", err)
	} else if !wrote {
		log.Info("host_info.json exists; left as is")
	}
}

// alive checks, within limit, that the engine's lock is free and the API
// answers its own healthcheck over the listener: what WATCHDOG=1 vouches
// for.
func alive(engine *task.Engine, addr string, limit time.Duration) bool {
	if host, port, err := net.SplitHostPort(addr); err == nil {
		if ip := net.ParseIP(host); ip == nil || ip.IsUnspecified() {
			addr = net.JoinHostPort("127.0.0.1", port)
		}
	}
	done := make(chan bool, 1)
	go func() {
		engine.List()
		c := http.Client{Timeout: limit}
		resp, err := c.Get("http://" + addr + "/api/healthcheck")
		if err == nil {
			resp.Body.Close()
		}
		done <- err == nil && resp.StatusCode == http.StatusOK
	}()
	select {
	case ok := <-done:
		return ok
	case <-time.After(limit):
		return false
	}
}
