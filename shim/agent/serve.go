package agent

// The shim's API and metrics listeners, and who may call them.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/httpapi"
	"github.com/tandem-run/tandem/common/version"
	"github.com/tandem-run/tandem/shim/gpu"
	"github.com/tandem-run/tandem/shim/metrics"
	"github.com/tandem-run/tandem/shim/origin"
	"github.com/tandem-run/tandem/shim/principal"
	"github.com/tandem-run/tandem/shim/server"
)

// startAPI serves the shim API. Its stop cancels component installs, then
// shuts the server down (at once when the API asked for force).
func (a *agent) startAPI(ctx context.Context) error {
	mon := a.startGPUHealth(ctx)
	inst := hostInstance{gpus: a.gpus, health: instanceHealth{docker: a.rt.Ping, gpus: func(context.Context) *api.DCGMHealth { return mon.Health() },
		runner: func(ctx context.Context) string {
			return runnerProblem(a.runnerComp.Info(ctx).Status, a.tcfg.RunnerBinary)
		}}}
	var gpuMetrics server.GPUMetrics
	if a.vendor == api.GPUVendorNVIDIA {
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
		RunnerHTTPPort:    a.tcfg.RunnerHTTPPort,
		Tasks:             a.engine,
		Runner:            a.runnerComp,
		Shim:              a.shimComp,
		InstallCtx:        installCtx,
		Instance:          inst,
		GPUMetrics:        gpuMetrics,
		Stopper:           a.sd,
		Readiness:         recovered{done: a.ready},
		SubmitWait:        a.cfg.SubmitWait,
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
// read-only counters for a scraper anywhere, on slots shared fairly among
// peers (metrics.Listen); nothing else of the API answers there.
func (a *agent) startMetrics(h http.Handler) error {
	ln, err := net.Listen("tcp", a.cfg.MetricsAddress)
	if err != nil {
		return fmt.Errorf("listen %s (--metrics-address): %w", a.cfg.MetricsAddress, err)
	}
	l := metrics.Listen(ln, h, a.log)
	a.OnStop(func() { _ = l.Close() })
	a.log.Info("metrics serving", "addr", l.Addr().String())
	return nil
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
		sock, _ := dockerSocket()
		a.policy = &principal.Policy{Root: a.cfg.PolicyRoot, Allow: a.cfg.APIAllowUsers, DockerSocket: sock, Log: a.log}
		a.log.Info("API callers admitted", "rule", a.policy.String())
	}
	return a.policy
}
