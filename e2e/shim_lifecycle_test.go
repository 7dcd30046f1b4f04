package e2e

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/e2e/testenv"
)

// A shim started in service mode with a runner download URL fetches the
// runner, writes host_info.json, installs a new runner through the API, and
// on /api/shutdown exits 0 leaving running containers alone.
func TestShimServiceModeComponentsAndShutdown(t *testing.T) {
	t.Parallel()
	// Real runners: an install must be an ELF that answers as the runner.
	v1, err := os.ReadFile(testenv.Binaries(t).Runner)
	if err != nil {
		t.Fatal(err)
	}
	oldDir := t.TempDir()
	buildOld(t, oldDir, "0.0.2")
	v2, err := os.ReadFile(filepath.Join(oldDir, "dstack-runner"))
	if err != nil {
		t.Fatal(err)
	}
	files := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/v1/dstack-runner":
			_, _ = w.Write(v1)
		case "/v2/dstack-runner":
			_, _ = w.Write(v2)
		default:
			http.NotFound(w, r)
		}
	}))
	defer files.Close()
	runnerPath := filepath.Join(t.TempDir(), "bin", "dstack-runner")
	h := startShim(t, runnerPath, []string{"DSTACK_RUNNER_DOWNLOAD_URL=" + files.URL + "/v1/dstack-runner", "DSTACK_SERVICE_MODE=1"})
	ctx := context.Background()

	comps, err := h.client.Components(ctx)
	if err != nil || comps[0].Name != api.ComponentRunner || comps[0].Status != api.ComponentInstalled || comps[0].Version != "0.21.3" {
		t.Fatalf("runner downloaded at start: %+v %v", comps, err)
	}
	if comps[1].Name != api.ComponentShim || comps[1].Status != api.ComponentInstalled || comps[1].Version != "0.21.3" {
		t.Fatalf("shim component: %+v", comps[1])
	}
	var hi api.HostInfo
	var b []byte
	for deadline := time.Now().Add(15 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		// Written after Docker answered, while the API already serves.
		if b, err = os.ReadFile(filepath.Join(h.home, "host_info.json")); err == nil {
			break
		}
	}
	if err != nil || json.Unmarshal(b, &hi) != nil {
		t.Fatalf("host_info.json: %v %s", err, b)
	}
	if hi.CPUs != runtime.NumCPU() || hi.Memory == 0 || hi.DiskSize == 0 || hi.GPUVendor != api.GPUVendorNone || hi.GPUCount != 0 {
		t.Fatalf("host info: %+v", hi)
	}

	cfg := h.submit(api.TaskConfig{})
	info := h.wait(cfg.ID, time.Minute, running)

	if err := h.client.InstallComponent(ctx, api.ComponentRunner, files.URL+"/v2/dstack-runner"); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		comps, _ = h.client.Components(ctx)
		if comps[0].Status == api.ComponentInstalled && comps[0].Version == "0.0.2" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("install via API: %+v", comps)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := h.client.InstallComponent(ctx, api.ComponentRunner, files.URL+"/missing"); err != nil {
		t.Fatal(err) // accepted; fails in the background
	}

	if err := h.client.Shutdown(ctx, false); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-h.exited:
		if err != nil {
			t.Fatalf("shutdown must exit 0: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("shim did not exit after /api/shutdown")
	}
	state, err := testenv.Docker(ctx, "inspect", "--format", "{{.State.Running}}", info.ContainerID)
	if err != nil || strings.TrimSpace(state) != "true" {
		t.Fatalf("containers must survive a shim shutdown: %q %v", state, err)
	}
}

// With the Docker daemon unreachable the shim still serves, a task ends
// with Docker's own words instead of hanging or crashing the shim, and the
// instance reports itself unhealthy.
func TestShimWithDockerDown(t *testing.T) {
	t.Parallel()
	h := startShim(t, runnerScript(t, `exit 0`), []string{"DOCKER_HOST=unix:///nonexistent/docker.sock"})
	cfg := h.submit(api.TaskConfig{ImageName: "busybox:1.36"})
	info := h.wait(cfg.ID, time.Minute, terminated)
	if info.TerminationReason != api.ReasonCreatingContainerError || !strings.Contains(info.TerminationMessage, "Cannot connect to the Docker daemon") {
		t.Fatalf("%+v", info)
	}
	// It never got a container, so removing it needs no Docker.
	if err := h.client.RemoveTask(context.Background(), cfg.ID); err != nil {
		t.Fatalf("remove of a task that never got a container, Docker down: %v", err)
	}
	if _, err := h.client.GetTask(context.Background(), cfg.ID); err == nil {
		t.Fatal("the removed task is still listed")
	}
	if _, err := h.client.Healthcheck(context.Background()); err != nil {
		t.Fatal(err)
	}
	// The instance reports why, where the dstack server reads health.
	hl, err := h.client.InstanceHealth(context.Background())
	if err != nil || hl.DCGM == nil || hl.DCGM.OverallHealth != 20 || !strings.Contains(hl.DCGM.Incidents[0].ErrorMessage, "Docker is not running on this host") {
		t.Fatalf("instance health with Docker down: %+v %v", hl.DCGM, err)
	}
}
