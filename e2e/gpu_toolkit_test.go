package e2e

import (
	"context"
	"encoding/json"
	"errors"
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

// The stand-in GPUs of the CDI spec the GPU wiring tests write: this
// machine has none, so ours is /dev/null as /dev/nvidia0, the other one
// /dev/zero as /dev/nvidia1, each with an env of its own, and a device of
// the spec brings the spec's common mount (the driver's library, in a real
// spec).
const (
	cdiOurs  = "GPU-7a3d2c10-5e1f-4b8a-9c0d-1e2f3a4b5c6d"
	cdiOther = "GPU-0b1c2d3e-4f50-4617-8293-a4b5c6d7e8f9"
)

// writeCDISpec writes the stand-in GPUs' CDI spec into dir/cdi and returns
// that directory.
func writeCDISpec(t *testing.T, dir string) string {
	t.Helper()
	lib := filepath.Join(dir, "libcuda.so.1")
	writeFile(t, lib, "stand-in libcuda\n", 0o644)
	spec := map[string]any{
		"cdiVersion": "0.5.0",
		"kind":       "nvidia.com/gpu",
		"devices": []any{
			map[string]any{"name": cdiOurs, "containerEdits": map[string]any{
				"deviceNodes": []any{map[string]any{"path": "/dev/nvidia0", "hostPath": "/dev/null"}},
				"env":         []string{"TANDEM_CDI_GPU=" + cdiOurs},
			}},
			map[string]any{"name": cdiOther, "containerEdits": map[string]any{
				"deviceNodes": []any{map[string]any{"path": "/dev/nvidia1", "hostPath": "/dev/zero"}},
				"env":         []string{"TANDEM_CDI_OTHER=" + cdiOther},
			}},
		},
		"containerEdits": map[string]any{
			"mounts": []any{map[string]any{"hostPath": lib, "containerPath": "/usr/lib/libcuda.so.1", "options": []string{"ro", "nosuid", "nodev", "bind"}}},
		},
	}
	cdiDir := filepath.Join(dir, "cdi")
	writeJSON(t, filepath.Join(cdiDir, "nvidia.json"), spec)
	return cdiDir
}

// gpuWiring runs containers the way the shim wires GPUs on host's Docker,
// which must say it reaches NVIDIA GPUs via wantMode ("hook": the NVIDIA
// device request by UUID, dstack's; "cdi": CDI device names), and checks
// that a task gets its GPU's CDI edits and nothing else, that its GPU reads
// back by UUID (what recovery after a shim restart does), that a task
// without GPUs gets nothing, and that a GPU the spec lacks fails naming it.
func gpuWiring(t *testing.T, host, wantMode string) {
	t.Helper()
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
	if mode, err := rt.GPUMode(ctx); err != nil || mode != wantMode {
		t.Fatalf("GPU mode: %q %v, want %q", mode, err, wantMode)
	}

	show := `ls -l /dev/nvidia0 /dev/nvidia1 2>&1; echo "env ours=$TANDEM_CDI_GPU other=$TANDEM_CDI_OTHER"; cat /usr/lib/libcuda.so.1 2>&1; true`
	run := func(name string, ids []string) (string, string, error) {
		t.Helper()
		s := task.ContainerSpec{Name: name, Image: image, Cmd: []string{"sh", "-c", show}, NetworkMode: "none", Init: true}
		if ids != nil {
			// The engine's wiring for an NVIDIA host whose Docker says so.
			s.GPUs = gpu.Wire(api.GPUVendorNVIDIA, ids, wantMode == "cdi").Request
		}
		id, err := rt.Create(ctx, s)
		if err != nil {
			return "", "", err
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

	id, out, err := run("gpu-task", []string{cdiOurs})
	if err != nil {
		t.Fatalf("a task with our GPU: %v", err)
	}
	// /dev/null's numbers (1, 3) at /dev/nvidia0; no /dev/nvidia1.
	if !regexp.MustCompile(`(?m)^c.*\b1,\s+3\b.*/dev/nvidia0$`).MatchString(out) || !strings.Contains(out, "/dev/nvidia1: No such file") {
		t.Errorf("device nodes in the GPU task:\n%s", out)
	}
	if !strings.Contains(out, "env ours="+cdiOurs+" other=\n") {
		t.Errorf("the GPU's env (and not the other's):\n%s", out)
	}
	if !strings.Contains(out, "stand-in libcuda") {
		t.Errorf("the spec's common mount:\n%s", out)
	}
	st, err := rt.Inspect(ctx, id)
	if err != nil || !slices.Equal(st.GPUIDs, []string{cdiOurs}) {
		t.Errorf("the container's GPUs read back: %v %v", st.GPUIDs, err)
	}

	_, out, err = run("cpu-task", nil)
	if err != nil {
		t.Fatalf("a task without GPUs: %v", err)
	}
	if !strings.Contains(out, "/dev/nvidia0: No such file") || !strings.Contains(out, "env ours= other=\n") || strings.Contains(out, "stand-in libcuda") {
		t.Errorf("a task without GPUs got some:\n%s", out)
	}

	const unknown = "GPU-ffffffff-ffff-4fff-8fff-ffffffffffff"
	if _, _, err := run("unknown-gpu", []string{unknown}); !errors.Is(err, task.ErrNoCDIDevice) || !strings.Contains(err.Error(), unknown) {
		t.Errorf("a GPU the CDI spec lacks: error %v, want task.ErrNoCDIDevice naming it", err)
	}
}

// TestNvidiaRuntimeInCDIModeTakesTheShimsGPURequest: on a host whose
// Docker runs NVIDIA's real nvidia-container-runtime in mode "cdi" as its
// default runtime (built from the toolkit's module), the GPU request the
// shim makes there (dstack's: the NVIDIA device request by UUID, with
// capabilities) reaches the container as that GPU's CDI edits only, and
// Docker's legacy hook, which the request brings, never runs (the runtime
// drops it).
func TestNvidiaRuntimeInCDIModeTakesTheShimsGPURequest(t *testing.T) {
	testenv.RequireDocker(t)
	toolkit := testenv.NvidiaToolkit(t)
	dir := t.TempDir()
	cdiDir := writeCDISpec(t, dir)

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
	gpuWiring(t, host, "hook")
	if _, err := os.Stat(marker); err == nil {
		t.Error("Docker's legacy NVIDIA hook ran: the runtime in CDI mode must drop it")
	}
	if b, _ := os.ReadFile(runtimeLog); !strings.Contains(string(b), "nvidia.com/gpu="+cdiOurs) {
		t.Errorf("the runtime's log names no CDI device for %s:\n%s", cdiOurs, testenv.Tail(b, 30))
	}
}

// TestDockerCDITakesTheShimsGPURequest: on a host whose Docker takes CDI
// device requests itself (Docker 26 with features.cdi, from Debian) and
// has no NVIDIA runtime, the shim asks for nvidia.com/gpu=<UUID>, and the
// container gets that GPU's CDI edits only.
func TestDockerCDITakesTheShimsGPURequest(t *testing.T) {
	testenv.RequireDocker(t)
	docker := testenv.CDIDocker(t)
	dir := t.TempDir()
	cdiDir := writeCDISpec(t, dir)
	config := filepath.Join(dir, "daemon.json")
	writeJSON(t, config, map[string]any{"features": map[string]bool{"cdi": true}, "cdi-spec-dirs": []string{cdiDir}})
	host, _ := privateDockerd(t, []string{"env", "PATH=" + docker + ":" + os.Getenv("PATH")}, "--config-file", config)
	gpuWiring(t, host, "cdi")
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
