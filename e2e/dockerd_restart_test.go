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

// The shim keeps serving while dockerd restarts, reports the last known
// state meanwhile, and reports the task's real end once Docker is back.
// The daemon restarted is a private one of the test's (issue 42: it used to
// kill every dockerd on the machine by name and start a shared one).
func TestShimSurvivesDockerdRestart(t *testing.T) {
	testenv.RequireDocker(t)
	if os.Geteuid() != 0 {
		if testenv.InCI() {
			t.Fatal("CI runs as root")
		}
		t.Skip("a dockerd of its own needs root")
	}
	d := testenv.StartDockerd(t, nil, 60*time.Second)
	img := testenv.Busybox(t)
	load := exec.Command("sh", "-c", "docker save "+img+" | DOCKER_HOST="+d.Host+" docker load")
	if out, err := load.CombinedOutput(); err != nil {
		t.Fatalf("load %s into the test's dockerd: %v %s", img, err, out)
	}
	p := newShimProc(t, runnerScript(t, exitOnFile))
	p.env = []string{"DOCKER_HOST=" + d.Host}
	p.start()
	ctx := context.Background()
	cfg := api.TaskConfig{ID: randomID("dr"), Name: "rs-" + strings.ToLower(randomID("d")), ImageName: img,
		InstanceMounts: []api.InstanceMountPoint{{InstancePath: t.TempDir(), Path: "/ctl"}}}
	if err := p.client.SubmitTask(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	p.waitStatus(cfg.ID, running)

	done := make(chan time.Duration)
	go func() {
		began := time.Now()
		d.Restart(t, 90*time.Second)
		done <- time.Since(began)
	}()
	// While Docker is away the shim answers with the last known state.
	answered := 0
	for waiting := true; waiting; {
		select {
		case d := <-done:
			t.Logf("dockerd was restarted in %s", d)
			waiting = false
		case <-time.After(20 * time.Millisecond):
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
