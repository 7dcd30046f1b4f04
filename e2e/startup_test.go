package e2e

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/shimclient"
	"github.com/tandem-run/tandem/e2e/testenv"
	"github.com/tandem-run/tandem/internal/gpufixture"
	"github.com/tandem-run/tandem/shim/task"
)

// privateDockerd starts a dockerd of the test's own (its socket, data and
// exec roots, its own bridge), so freezing it disturbs no other test. Not
// --bridge=none: that makes dockerd delete docker0, the machine daemon's
// bridge, under every other test. wrap and extra go to
// testenv.StartDockerd. It returns the DOCKER_HOST and the pid.
func privateDockerd(t *testing.T, wrap []string, extra ...string) (string, int) {
	t.Helper()
	if os.Geteuid() != 0 {
		if testenv.InCI() {
			t.Fatal("CI runs as root")
		}
		t.Skip("dockerd needs root")
	}
	t.Cleanup(func() {
		// dockerd must never take the machine daemon's bridge with it.
		if exec.Command("ip", "link", "show", "docker0").Run() != nil {
			t.Error("docker0 is gone after the private dockerd")
		}
	})
	br := "tdm" + randomID("")[1:8]
	for _, args := range [][]string{{"link", "add", br, "type", "bridge"}, {"addr", "add", "172.31.254.1/24", "dev", br}, {"link", "set", br, "up"}} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v %s", args, err, out)
		}
	}
	t.Cleanup(func() { _ = exec.Command("ip", "link", "del", br).Run() })
	d := testenv.StartDockerd(t, wrap, 30*time.Second, append([]string{"--bridge", br}, extra...)...)
	t.Cleanup(func() { _ = syscall.Kill(d.Pid, syscall.SIGCONT) }) // never leave it frozen
	return d.Host, d.Pid
}

// TestShimServesWhileDockerIsFrozen (issue 16): with dockerd stopped by
// SIGSTOP the shim still answers its healthcheck within a second of start;
// task calls say 503 while recovery waits on Docker, and recovery finishes
// once dockerd continues.
func TestShimServesWhileDockerIsFrozen(t *testing.T) {
	host, pid := privateDockerd(t, nil)
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	bins := testenv.Binaries(t)
	home := t.TempDir()
	testenv.UnmountUnder(t, home)
	_, port, _ := net.SplitHostPort(testenv.FreeAddr(t))
	cmd := exec.Command(bins.Shim, "--shim-home", home, "--shim-http-port", port, "--runner-binary-path", bins.Runner)
	cmd.Env = append(os.Environ(), "DOCKER_HOST="+host)
	testenv.StartDaemon(t, cmd)
	start := time.Now()
	c, _ := shimclient.New("127.0.0.1:" + port)
	ctx := context.Background()
	for {
		hctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		_, err := c.Healthcheck(hctx)
		cancel()
		if err == nil {
			break
		}
		if time.Since(start) > 3*time.Second {
			t.Fatalf("no healthcheck with dockerd frozen: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("healthcheck answered %s after start with dockerd frozen", time.Since(start).Round(time.Millisecond))
	c.SetTimeout(30 * time.Second)
	_, err := c.ListTasks(ctx)
	var se *api.StatusError
	if !errors.As(err, &se) || se.Code != 503 || !strings.Contains(se.Message, "restoring") {
		t.Fatalf("task list while Docker is frozen: %v", err)
	}
	if err := syscall.Kill(pid, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		if _, err := c.ListTasks(ctx); err == nil {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("recovery did not finish after SIGCONT: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestShimChurnNoResurrection (issue 16): three rounds of 40 real
// containers, each terminated and removed as soon as it runs, while the
// reconcile loop ticks every 50 ms. No removed task may come back.
func TestShimChurnNoResurrection(t *testing.T) {
	h := startShim(t, runnerScript(t, "sleep 600"), nil, "--reconcile-interval", "50ms")
	// 40 containers at once on a loaded 2-core CI machine: Docker's stop
	// and remove can take longer than the default 9 s per call.
	h.client.SetTimeout(3 * time.Minute)
	ctx := context.Background()
	removed := map[string]bool{}
	for round := range 3 {
		var wg sync.WaitGroup
		errs := make(chan error, 40)
		slots := make(chan struct{}, 10) // 10 in flight: 2-core CI machines
		for i := range 40 {
			cfg := api.TaskConfig{ID: fmt.Sprintf("churn-%d-%d-%s", round, i, randomID("")[1:]), Name: "rs-" + strings.ToLower(randomID("c")), ImageName: h.image}
			removed[cfg.ID] = true
			h.names = append(h.names, task.ContainerName(cfg.Name, cfg.ID))
			wg.Add(1)
			go func() {
				defer wg.Done()
				slots <- struct{}{}
				defer func() { <-slots }()
				if err := h.client.SubmitTask(ctx, cfg); err != nil {
					errs <- err
					return
				}
				for deadline := time.Now().Add(2 * time.Minute); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
					if info, err := h.client.GetTask(ctx, cfg.ID); err == nil && (info.Status == api.TaskRunning || info.Status == api.TaskTerminated) {
						break
					}
				}
				if _, err := h.client.TerminateTask(ctx, cfg.ID, api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByServer}); err != nil {
					errs <- fmt.Errorf("terminate %s: %w", cfg.ID, err)
					return
				}
				if err := h.client.RemoveTask(ctx, cfg.ID); err != nil {
					errs <- fmt.Errorf("remove %s: %w", cfg.ID, err)
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
	}
	time.Sleep(500 * time.Millisecond) // several more reconcile ticks
	list, err := h.client.ListTasks(ctx)
	if err != nil {
		t.Fatal(err)
	}
	back := 0
	for _, it := range list {
		if removed[it.ID] {
			back++
			t.Errorf("removed task %s came back as %s", it.ID, it.Status)
		}
	}
	entries, _ := os.ReadDir(filepath.Join(h.home, "tasks"))
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), "churn-") {
			t.Errorf("record rewritten for a removed task: %s", e.Name())
		}
	}
	t.Logf("3 × 40 tasks submitted, terminated and removed: %d came back", back)
}

// TestShimRunsAgainstAFixtureHostRoot (issue 42, item 5): the binary reads
// the host's files under --host-root, as node_exporter's --path.rootfs: a
// fixture tree of two AMD Instinct cards is what it reports.
func TestShimRunsAgainstAFixtureHostRoot(t *testing.T) {
	root := t.TempDir()
	gpufixture.KFD(t, root, "6.7.0")
	gpufixture.AMDCard(t, root, 128, "0000:10:00.0", 196608, "AMD Instinct MI300X", 0)
	gpufixture.AMDCard(t, root, 129, "0000:11:00.0", 196608, "AMD Instinct MI300X", 0)
	h := startShim(t, testenv.Binaries(t).Runner, nil, "--host-root", root)
	ctx := context.Background()
	info, err := h.client.InstanceInfo(ctx)
	if err != nil || info.GPUVendor != api.GPUVendorAMD || info.GPUDriverVersion != "6.7.0" {
		t.Fatalf("instance info from the fixture: %+v %v", info, err)
	}
	host, err := h.client.InstanceHost(ctx)
	if err != nil || host.GPUCount != 2 {
		t.Fatalf("instance host from the fixture: %+v %v", host, err)
	}
}
