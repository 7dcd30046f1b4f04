package e2e

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/e2e/testenv"
)

// restartDockerd stops and starts the Docker daemon (systemd when it runs
// it, else the background dockerd `make deps` started) and waits for it.
// Not parallel: Go runs it before any parallel test resumes.
func restartDockerd(t *testing.T) (downFor time.Duration) {
	t.Helper()
	start := time.Now()
	if exec.Command("systemctl", "is-active", "--quiet", "docker").Run() == nil {
		if out, err := exec.Command("systemctl", "restart", "docker").CombinedOutput(); err != nil {
			t.Fatalf("systemctl restart docker: %v %s", err, out)
		}
	} else {
		_ = exec.Command("pkill", "-TERM", "-x", "dockerd").Run()
		for i := 0; i < 200 && exec.Command("pgrep", "-x", "dockerd").Run() == nil; i++ {
			time.Sleep(100 * time.Millisecond)
		}
		logf, _ := os.OpenFile("/var/log/tandem-dockerd.log", os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
		cmd := exec.Command("dockerd")
		cmd.Stdout, cmd.Stderr = logf, logf
		// It replaces the machine's daemon and outlives the test on purpose;
		// it must not hold any descriptor of the test run.
		testenv.Isolate(cmd)
		if err := cmd.Start(); err != nil {
			t.Fatalf("start dockerd: %v", err)
		}
		go func() { _ = cmd.Wait() }() // it outlives the test on purpose
	}
	for {
		if exec.Command("docker", "info").Run() == nil {
			return time.Since(start)
		}
		if time.Since(start) > 90*time.Second {
			t.Fatal("dockerd did not come back")
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// The shim keeps serving while dockerd restarts, reports the last known
// state meanwhile, and reports the task's real end once Docker is back.
func TestShimSurvivesDockerdRestart(t *testing.T) {
	testenv.RequireDocker(t)
	if os.Geteuid() != 0 {
		if testenv.InCI() {
			t.Fatal("CI runs as root")
		}
		t.Skip("restarting dockerd needs root")
	}
	p := newShimProc(t, runnerScript(t, exitOnFile))
	p.start()
	ctx := context.Background()
	cfg := api.TaskConfig{ID: randomID("dr"), Name: "rs-" + strings.ToLower(randomID("d")), ImageName: testenv.Busybox(t),
		InstanceMounts: []api.InstanceMountPoint{{InstancePath: t.TempDir(), Path: "/ctl"}}}
	if err := p.client.SubmitTask(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	p.waitStatus(cfg.ID, running)

	done := make(chan time.Duration)
	go func() { done <- restartDockerd(t) }()
	// While Docker is away the shim answers with the last known state.
	answered := 0
	for waiting := true; waiting; {
		select {
		case d := <-done:
			t.Logf("dockerd was restarted in %s", d)
			waiting = false
		case <-time.After(200 * time.Millisecond):
			if _, err := p.client.Healthcheck(ctx); err != nil {
				t.Fatalf("shim stopped serving while dockerd restarted: %v", err)
			}
			if _, err := p.client.GetTask(ctx, cfg.ID); err != nil {
				t.Fatalf("task unknown while dockerd restarted: %v", err)
			}
			answered++
		}
	}
	// Without live-restore the daemon's restart stopped the container: the
	// shim must say so, not keep it running forever.
	info := p.waitStatus(cfg.ID, terminated)
	if info.TerminationReason != api.ReasonContainerExitedWithError {
		t.Fatalf("after dockerd restart: %+v", info)
	}
	if err := p.client.RemoveTask(ctx, cfg.ID); err != nil {
		t.Fatalf("remove after dockerd restart: %v", err)
	}
	if answered == 0 {
		t.Fatal("the restart was too quick to check the shim answered meanwhile")
	}
}
