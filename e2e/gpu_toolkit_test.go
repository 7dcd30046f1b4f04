package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/e2e/testenv"
	"github.com/tandem-run/tandem/shim/dockerrt"
	"github.com/tandem-run/tandem/shim/gpu"
	"github.com/tandem-run/tandem/shim/task"
)

// TestNvidiaRuntimeInCDIModeTakesTheShimsGPURequest: on a host whose
// Docker runs NVIDIA's real nvidia-container-runtime in mode "cdi" as its
// default runtime (built from the toolkit's module; a CDI spec of one
// stand-in GPU, since this machine has none), the GPU request the shim
// makes (dstack's: the NVIDIA device request by UUID, with capabilities)
// reaches the container as that GPU's CDI edits and nothing else: its
// device node, its env and the spec's common mount, not another GPU's.
// Docker's legacy hook, which the request brings, never runs (the runtime
// drops it). The container's GPU reads back by UUID (what recovery after a
// shim restart does), a container without a request gets nothing, and a
// GPU the spec does not know fails at start with the runtime's error.
func TestNvidiaRuntimeInCDIModeTakesTheShimsGPURequest(t *testing.T) {
	testenv.RequireDocker(t)
	toolkit := testenv.NvidiaToolkit(t)
	dir := t.TempDir()
	const (
		ours  = "GPU-7a3d2c10-5e1f-4b8a-9c0d-1e2f3a4b5c6d"
		other = "GPU-0b1c2d3e-4f50-4617-8293-a4b5c6d7e8f9"
	)

	// The CDI spec: ours is /dev/null as /dev/nvidia0, the other one
	// /dev/zero as /dev/nvidia1; a device of the spec brings its common
	// mount (the driver's library, in a real spec).
	lib := filepath.Join(dir, "libcuda.so.1")
	if err := os.WriteFile(lib, []byte("stand-in libcuda\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	spec := map[string]any{
		"cdiVersion": "0.5.0",
		"kind":       "nvidia.com/gpu",
		"devices": []any{
			map[string]any{"name": ours, "containerEdits": map[string]any{
				"deviceNodes": []any{map[string]any{"path": "/dev/nvidia0", "hostPath": "/dev/null"}},
				"env":         []string{"TANDEM_CDI_GPU=" + ours},
			}},
			map[string]any{"name": other, "containerEdits": map[string]any{
				"deviceNodes": []any{map[string]any{"path": "/dev/nvidia1", "hostPath": "/dev/zero"}},
				"env":         []string{"TANDEM_CDI_OTHER=" + other},
			}},
		},
		"containerEdits": map[string]any{
			"mounts": []any{map[string]any{"hostPath": lib, "containerPath": "/usr/lib/libcuda.so.1", "options": []string{"ro", "nosuid", "nodev", "bind"}}},
		},
	}
	cdiDir := filepath.Join(dir, "cdi")
	writeJSON(t, filepath.Join(cdiDir, "nvidia.json"), spec)

	// The runtime's config (through the toolkit's own override variable),
	// and Docker's legacy hook, which must be on dockerd's PATH for it to
	// take NVIDIA device requests: here it only leaves a mark.
	runc, err := exec.LookPath("runc")
	if err != nil {
		t.Fatalf("runc: %v", err)
	}
	runtimeLog := filepath.Join(dir, "nvidia-runtime.log")
	config := filepath.Join(dir, "config.toml")
	writeFile(t, config, fmt.Sprintf(`[nvidia-container-runtime]
debug = %q
log-level = "debug"
mode = "cdi"
runtimes = [%q]

[nvidia-container-runtime.modes.cdi]
annotation-prefixes = ["cdi.k8s.io/"]
default-kind = "nvidia.com/gpu"
spec-dirs = [%q]

[nvidia-ctk]
path = %q
`, runtimeLog, runc, cdiDir, filepath.Join(toolkit, "nvidia-ctk")), 0o644)
	wrapper := filepath.Join(dir, "nvidia-runtime")
	writeFile(t, wrapper, fmt.Sprintf("#!/bin/sh\nNVIDIA_CTK_CONFIG_FILE_PATH=%s exec %s \"$@\"\n", config, filepath.Join(toolkit, "nvidia-container-runtime")), 0o755)
	hookDir := filepath.Join(dir, "hookbin")
	marker := filepath.Join(dir, "legacy-hook-ran")
	writeFile(t, filepath.Join(hookDir, "nvidia-container-runtime-hook"), "#!/bin/sh\ntouch "+marker+"\ncat >/dev/null\n", 0o755)

	host, _ := privateDockerd(t, []string{"env", "PATH=" + hookDir + ":" + os.Getenv("PATH")},
		"--add-runtime", "nvidia="+wrapper, "--default-runtime", "nvidia")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	image := testenv.Busybox(t)
	load := exec.CommandContext(ctx, "sh", "-c", `docker save "$1" | DOCKER_HOST="$2" docker load -q`, "sh", image, host)
	if out, err := load.CombinedOutput(); err != nil {
		t.Fatalf("load %s: %v %s", image, err, out)
	}

	t.Setenv("DOCKER_HOST", host)
	rt, err := dockerrt.New()
	if err != nil {
		t.Fatal(err)
	}
	defer rt.Close()
	if mode, err := rt.GPUMode(ctx); err != nil || mode != "hook" {
		t.Fatalf("GPU mode with the NVIDIA runtime registered: %q %v", mode, err)
	}

	show := `ls -l /dev/nvidia0 /dev/nvidia1 2>&1; echo "env ours=$TANDEM_CDI_GPU other=$TANDEM_CDI_OTHER"; cat /usr/lib/libcuda.so.1 2>&1; true`
	run := func(name string, ids []string) (string, string, error) {
		t.Helper()
		s := task.ContainerSpec{Name: name, Image: image, Cmd: []string{"sh", "-c", show}, NetworkMode: "none", Init: true}
		if ids != nil {
			// The engine's wiring for an NVIDIA host whose Docker has the
			// NVIDIA runtime: the device request by UUID.
			s.GPUs = gpu.Wire(api.GPUVendorNVIDIA, ids, false).Request
		}
		id, err := rt.Create(ctx, s)
		if err != nil {
			t.Fatalf("create %s: %v", name, err)
		}
		t.Cleanup(func() { _ = rt.Remove(context.Background(), id) })
		if err := rt.Start(ctx, id); err != nil {
			return id, "", err
		}
		if code, err := rt.Wait(ctx, id); err != nil || code != 0 {
			logs, _ := rt.LogTail(ctx, id, 20)
			t.Fatalf("%s: exit %d %v\n%s", name, code, err, logs)
		}
		logs, err := rt.LogTail(ctx, id, 20)
		if err != nil {
			t.Fatal(err)
		}
		return id, logs, nil
	}

	id, out, err := run("gpu-task", []string{ours})
	if err != nil {
		b, _ := os.ReadFile(runtimeLog)
		t.Fatalf("start with our GPU: %v\nruntime log:\n%s", err, lastLines(string(b), 30))
	}
	// /dev/null's numbers (1, 3) at /dev/nvidia0; no /dev/nvidia1.
	if !regexp.MustCompile(`(?m)^c.*\b1,\s+3\b.*/dev/nvidia0$`).MatchString(out) || !strings.Contains(out, "/dev/nvidia1: No such file") {
		t.Errorf("device nodes in the GPU task:\n%s", out)
	}
	if !strings.Contains(out, "env ours="+ours+" other=\n") {
		t.Errorf("the GPU's env (and not the other's):\n%s", out)
	}
	if !strings.Contains(out, "stand-in libcuda") {
		t.Errorf("the spec's common mount:\n%s", out)
	}
	if _, err := os.Stat(marker); err == nil {
		t.Error("Docker's legacy NVIDIA hook ran: the runtime in CDI mode must drop it")
	}
	b, _ := os.ReadFile(runtimeLog)
	if !strings.Contains(string(b), "nvidia.com/gpu="+ours) {
		t.Errorf("the runtime's log names no CDI device for %s:\n%s", ours, lastLines(string(b), 30))
	}
	st, err := rt.Inspect(ctx, id)
	if err != nil || !slices.Equal(st.GPUIDs, []string{ours}) {
		t.Errorf("the container's GPUs read back: %v %v", st.GPUIDs, err)
	}

	_, out, err = run("cpu-task", nil)
	if err != nil {
		t.Fatalf("start without GPUs: %v", err)
	}
	if !strings.Contains(out, "/dev/nvidia0: No such file") || !strings.Contains(out, "env ours= other=\n") || strings.Contains(out, "stand-in libcuda") {
		t.Errorf("a task without GPUs got some:\n%s", out)
	}

	const unknown = "GPU-ffffffff-ffff-4fff-8fff-ffffffffffff"
	if _, _, err := run("unknown-gpu", []string{unknown}); err == nil || !strings.Contains(err.Error(), unknown) {
		t.Errorf("a GPU the CDI spec lacks: start error %v, want one naming it", err)
	}
}

func writeJSON(t *testing.T, path string, v any) {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, path, string(b), 0o644)
}

func writeFile(t *testing.T, path, data string, mode os.FileMode) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(data), mode); err != nil {
		t.Fatal(err)
	}
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
