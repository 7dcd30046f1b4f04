package agent

// Being supervised: systemd's readiness and watchdog, shutdown, and what
// the host and Docker say of themselves at start.

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"sync"
	"time"

	"github.com/tandem-run/tandem/common/memtrim"
	"github.com/tandem-run/tandem/common/sdnotify"
	"github.com/tandem-run/tandem/shim/dockerrt"
	"github.com/tandem-run/tandem/shim/gpu"
	"github.com/tandem-run/tandem/shim/hostinfo"
	"github.com/tandem-run/tandem/shim/task"
)

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

// dockerFacts asks Docker, bounded, for its root dir (host_info's disk)
// and the dirs it reads CDI specs from, and logs its version. A daemon that
// does not answer leaves "/", logged, and answered false.
func dockerFacts(ctx context.Context, rt *dockerrt.Runtime, log *slog.Logger) (diskPath string, cdiDirs []string, answered bool) {
	ictx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	info, err := rt.Client().Info(ictx)
	if err != nil {
		log.Error("docker is not answering; tasks will fail until it does", "err", err)
		return "/", nil, false
	}
	log.Info("docker", "server_version", info.ServerVersion, "root", info.DockerRootDir, "runtimes", len(info.Runtimes))
	return info.DockerRootDir, info.CDISpecDirs, true
}

// checkCDISpecs warns at start when GPUs go to containers as CDI devices
// but no spec in Docker's CDI dirs names some of the host's GPUs: their
// tasks would fail at start (Docker 28.2 turns CDI on by default, spec or
// none). It returns those GPUs' ids. A shim that sees another filesystem
// than Docker's (in a container) may warn wrongly: it only warns.
func checkCDISpecs(log *slog.Logger, dirs []string, gpus []gpu.GPU) []string {
	names, problems := gpu.CDIGPUNames(dirs)
	for _, p := range problems {
		log.Warn("a CDI spec cannot be read; Docker skips it too", "err", p)
	}
	missing := gpu.CDIMissing(gpus, names)
	if len(missing) > 0 {
		log.Warn("Docker takes GPUs as CDI devices, but no CDI spec names these GPUs: their tasks fail to start until one does "+
			"(on the host: "+gpu.CDIGenerate+")", "gpus", missing, "spec_dirs", dirs)
		return missing
	}
	log.Info("CDI specs name every GPU", "gpus", len(gpus), "spec_dirs", dirs)
	return nil
}

// writeHostInfo writes host_info.json once (service mode).
func writeHostInfo(home string, gpus []gpu.GPU, diskPath string, log *slog.Logger) {
	hi, err := hostinfo.Collect(gpus, diskPath)
	if err != nil {
		log.Warn("host info is incomplete; writing what was read", "err", err)
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
