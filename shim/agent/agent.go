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
	"sync"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/httpapi"
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

// Run runs the shim until ctx ends or an API shutdown; running containers
// are never stopped on exit.
func Run(ctx context.Context, cfg Config) error {
	log, logFile, err := logging.ToFile(cfg.LogLevel, cfg.LogFormat, os.Stderr, filepath.Join(cfg.Home, "shim.log"))
	if err != nil {
		return err
	}
	defer logFile.Close()
	log.Info("dstack-shim starting", "version", version.String(), "tandem_version", version.Tandem(), "home", cfg.Home)

	// Components.
	tcfg := cfg.Task.WithDefaults()
	runnerComp := &component.Manager{Name: api.ComponentRunner, Path: tcfg.RunnerBinary, Log: log}
	shimComp := &component.Manager{Name: api.ComponentShim, Path: cfg.BinaryPath, Log: log}
	if cfg.RunnerDownloadURL != "" {
		if err := runnerComp.EnsureInstalled(ctx, cfg.RunnerDownloadURL); err != nil {
			return fmt.Errorf("install runner: %w", err)
		}
	}
	if info := runnerComp.Info(ctx); info.Status == api.ComponentError {
		return fmt.Errorf("runner binary %s does not answer `--version` as dstack-runner", tcfg.RunnerBinary)
	} else if info.Status == api.ComponentNotInstalled {
		log.Warn("runner binary is missing; tasks will fail until it is installed", "path", tcfg.RunnerBinary)
	}
	if info := shimComp.Info(ctx); info.Status == api.ComponentError {
		return fmt.Errorf("shim binary %s does not answer `--version` as dstack-shim", cfg.BinaryPath)
	}

	// Docker. A daemon that is down does not stop the shim from serving: the
	// API stays up and tasks report Docker's error (dstack restart-loops here).
	rt, err := dockerrt.New()
	if err != nil {
		return err
	}
	defer rt.Close()
	// GPUs: every vendor is asked; discrete GPUs of two vendors stop the
	// shim with a clear error instead of a silent pick.
	nvmlSrc := gpu.NewNVML()
	gpus, err := gpu.Discover(ctx, log, nvmlSrc, gpu.AMD{Root: "/"})
	if err != nil {
		return err
	}
	locks := gpu.NewLocksFor(gpus)
	var vendor api.GPUVendor
	if len(gpus) > 0 {
		vendor = gpus[0].Vendor
	}
	volumes := &volume.Manager{
		Root: tcfg.VolumesRoot,
		Resolvers: map[string]volume.Resolver{
			"aws": volume.AWS{List: volume.Lsblk},
			"gcp": volume.GCP{ByID: cfg.GCPDiskByID},
		},
		Log: log,
	}
	mx := metrics.New()
	volumes.Observe = mx.VolumeMount
	runnerComp.Observe, shimComp.Observe = mx.ComponentInstalled, mx.ComponentInstalled
	var taskNet task.Network
	if cfg.IsolatedNetwork != "" {
		taskNet = &netiso.Network{Name: cfg.IsolatedNetwork, Docker: rt.Client(), Log: log}
	}
	tcfg.Network, tcfg.Observer, tcfg.Volumes, tcfg.Home, tcfg.GPUVendor = taskNet, mx, volumes, cfg.Home, vendor
	engine := task.New(tcfg, rt, locks, &authkeys.Editor{}, log)

	// The API serves before anything waits on Docker: a hung daemon must not
	// make the instance look dead. Task calls wait (bounded) for recovery
	// below and answer 503 past it; the server retries.
	ready := make(chan struct{})
	go func() {
		defer close(ready)
		diskPath, answered := dockerFacts(ctx, rt, log)
		if answered && vendor == api.GPUVendorNVIDIA {
			engine.LearnGPUAccess() // logs how Docker reaches the GPUs, or why it cannot
		}
		if cfg.ServiceMode {
			writeHostInfo(cfg.Home, gpus, diskPath, log)
		}
		// Restart safety: tasks come back from their records, re-attached to
		// their containers; what Docker cannot answer for now is settled by
		// the reconcile loop once it does.
		if err := engine.Restore(ctx); err != nil {
			log.Warn("restoring tasks is incomplete until Docker answers", "err", err)
		}
	}()
	go func() {
		select {
		case <-ready:
			engine.ReconcileLoop(ctx, cmp.Or(cfg.ReconcileInterval, 5*time.Second))
		case <-ctx.Done():
		}
	}()

	inst := hostInstance{gpus: gpus, health: instanceHealth{docker: rt.Ping}}
	var gpuMetrics server.GPUMetrics
	if vendor == api.GPUVendorNVIDIA {
		xids := nvmlSrc.WatchXIDs(ctx)
		inst.health.gpus = func(context.Context) *api.DCGMHealth { return nvmlSrc.Health(xids()) }
		every := cfg.GPUMetricsInterval
		if every <= 0 {
			every = 5 * time.Second
		}
		m := nvidiaMetrics{nvml: &gpu.Metrics{NVML: nvmlSrc, Interval: every}}
		if cfg.DCGMExporterPort > 0 {
			m.exporter = &gpu.Exporter{URL: fmt.Sprintf("http://localhost:%d/metrics", cfg.DCGMExporterPort), Interval: every}
		}
		gpuMetrics = m
	}

	installCtx, cancelInstalls := context.WithCancel(context.Background())
	defer cancelInstalls()
	sd := newShutdown()
	e := server.New(server.Deps{
		Version:           version.String(),
		TandemVersion:     version.Tandem(),
		Tasks:             engine,
		Runner:            runnerComp,
		Shim:              shimComp,
		InstallCtx:        installCtx,
		Instance:          inst,
		GPUMetrics:        gpuMetrics,
		Stopper:           sd,
		Readiness:         recovered{done: ready},
		Log:               log,
		Metrics:           mx.Handler(metrics.Sources{Tasks: engine, GPUs: locks}),
		MetricsMiddleware: mx.Middleware(),
	})
	addr := net.JoinHostPort(cfg.HTTPAddress, strconv.Itoa(cfg.HTTPPort))
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("listen %s: %w", addr, err)
	}
	access := server.Access{AllowContainers: cfg.APIAllowContainers, Token: cfg.APIToken, AllowedHosts: cfg.APIAllowedHosts,
		Check: origin.Checker{}.CheckBatch, Log: log}
	e.Pre(access.Middleware())
	if cfg.APIAllowContainers {
		log.Warn("the shim API serves callers inside containers too (--api-allow-containers)")
	}
	hs := httpapi.NewServer(e, httpapi.DefaultLimits)
	// Who a connection is, is decided when it is accepted, before it holds
	// one of the API's slots: a container's connections are refused at
	// once, and the reserve is for the host.
	gate := httpapi.NewGate(ln, httpapi.DefaultLimits, access.Admit(), log)
	gate.Attach(hs)
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(gate) }()
	log.Info("shim API serving", "addr", gate.Addr().String())
	if cfg.Ready != nil {
		cfg.Ready(gate.Addr().String())
	}

	// systemd (Type=notify): ready once serving and recovered; the
	// watchdog hears from us only while the API and the engine answer.
	notify := sdnotify.FromEnv()
	stopWatch := make(chan struct{})
	go func() {
		select {
		case <-ready:
		case <-stopWatch:
			return
		}
		// Start-up is over: its pages of the binary go back (see memtrim).
		if !cfg.KeepStartupMemory {
			if r, err := memtrim.Release(); err != nil {
				log.Warn("releasing start-up memory", "err", err)
			} else {
				log.Debug("released start-up memory", "executable_rss_before", r.Before, "after", r.After)
			}
		}
		if err := notify.Send("READY=1"); err != nil {
			log.Warn("systemd notify", "err", err)
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
				if alive(engine, ln.Addr().String(), every) {
					_ = notify.Send("WATCHDOG=1")
				} else {
					log.Error("watchdog: the shim is not answering itself; systemd will restart it")
				}
			}
		}
	}()

	var force bool
	select {
	case err := <-errc:
		close(stopWatch)
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
		log.Info("signal received, shutting down")
	case force = <-sd.ch:
		log.Info("API shutdown requested", "force", force)
	}
	close(stopWatch)
	_ = notify.Send("STOPPING=1")
	cancelInstalls()
	if force {
		_ = hs.Close()
	} else {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := hs.Shutdown(sctx); err != nil {
			_ = hs.Close()
		}
	}
	if err := <-errc; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serve: %w", err)
	}
	engine.Shutdown()
	engine.Sync() // records on disk before the process goes
	log.Info("dstack-shim stopped; containers keep running")
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
