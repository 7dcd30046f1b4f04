package e2e

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/tandem-run/tandem/e2e/testenv"
)

// TestJobGPUMetricsOfEveryVendor runs the real runner in a container whose
// /dev and /sys are a fixture tree (TANDEM_RUNNER_METRICS_ROOT) and whose
// image has a fake vendor tool on PATH (a script printing a recorded
// answer), and reads /api/metrics as the server does: AMD (amd-smi, and the
// amdgpu sysfs without it) and Gaudi jobs report their GPUs in the very
// shape NVIDIA jobs do. Before, only nvidia-smi was read: an AMD job showed
// no GPU use.
func TestJobGPUMetricsOfEveryVendor(t *testing.T) {
	image := testenv.Busybox(t)
	type gpuJSON = map[string]any
	for _, tc := range []struct {
		name  string
		nodes []string          // fixture device nodes ("renderD<n>" a char device)
		sys   map[string]string // fixture sysfs files
		tool  string            // name on PATH
		out   string            // what the tool prints
		want  []gpuJSON
	}{
		{name: "nvidia", nodes: []string{"dev/nvidiactl"}, tool: "nvidia-smi", out: "2048, 87\n0, 0\n",
			want: []gpuJSON{{"gpu_memory_usage_bytes": float64(2 << 30), "gpu_util_percent": float64(87)}, {"gpu_memory_usage_bytes": float64(0), "gpu_util_percent": float64(0)}}},
		{name: "amd-smi", nodes: []string{"dev/kfd"}, tool: "amd-smi",
			out:  "gpu,gfx,gfx_clock,mem,mem_clock,encoder,decoder,vram_used,vram_total\n0,87,2100,41,1300,N/A,0,2048,196592\n1,0,132,0,900,N/A,0,0,196592\n",
			want: []gpuJSON{{"gpu_memory_usage_bytes": float64(2 << 30), "gpu_util_percent": float64(87)}, {"gpu_memory_usage_bytes": float64(0), "gpu_util_percent": float64(0)}}},
		{name: "amd sysfs", nodes: []string{"dev/kfd", "renderD128"}, sys: map[string]string{
			"sys/class/drm/renderD128/dev": "226:128\n", "sys/class/drm/renderD128/device/vendor": "0x1002\n",
			"sys/class/drm/renderD128/device/mem_info_vram_used": "2147483648\n", "sys/class/drm/renderD128/device/mem_info_vram_total": "206158430208\n",
			"sys/class/drm/renderD128/device/gpu_busy_percent": "87\n",
			// The host's other GPU, not mapped into this container.
			"sys/class/drm/renderD136/dev": "226:136\n", "sys/class/drm/renderD136/device/vendor": "0x1002\n",
			"sys/class/drm/renderD136/device/mem_info_vram_used": "1\n", "sys/class/drm/renderD136/device/mem_info_vram_total": "2\n",
			"sys/class/drm/renderD136/device/gpu_busy_percent": "100\n",
		}, want: []gpuJSON{{"gpu_memory_usage_bytes": float64(2 << 30), "gpu_util_percent": float64(87)}}},
		{name: "gaudi", nodes: []string{"dev/accel/accel0"}, tool: "hl-smi", out: "2048, 98304, 87 %\n0, 98304, 0 %\n",
			want: []gpuJSON{{"gpu_memory_usage_bytes": float64(2 << 30), "gpu_util_percent": float64(87)}, {"gpu_memory_usage_bytes": float64(0), "gpu_util_percent": float64(0)}}},
		{name: "amd, no source", nodes: []string{"dev/kfd"}, want: []gpuJSON{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			for _, n := range tc.nodes {
				if strings.HasPrefix(n, "renderD") {
					p := filepath.Join(root, "dev", "dri", n)
					if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
						t.Fatal(err)
					}
					if err := syscall.Mknod(p, syscall.S_IFCHR|0o600, 226<<8|128); err != nil {
						t.Fatalf("mknod: %v", err)
					}
					continue
				}
				writeFile(t, filepath.Join(root, n), "", 0o644)
			}
			for rel, data := range tc.sys {
				writeFile(t, filepath.Join(root, rel), data, 0o644)
			}
			flags := []string{"-v", root + ":/fixture:ro", "-e", "TANDEM_RUNNER_METRICS_ROOT=/fixture"}
			if tc.tool != "" {
				script := filepath.Join(t.TempDir(), tc.tool)
				writeFile(t, script, "#!/bin/sh\ncat <<'EOF'\n"+tc.out+"EOF\n", 0o755)
				flags = append(flags, "-v", script+":/usr/local/bin/"+tc.tool+":ro")
			}
			h := startRunnerDocker(t, image, flags)
			var body map[string]any
			for range 3 { // the server asks every 10 s: one log line, not one a call
				body = getMetrics(t, h)
			}
			keys := slices.Sorted(func(yield func(string) bool) {
				for k := range body {
					if !yield(k) {
						return
					}
				}
			})
			if want := []string{"cpu_usage_micro", "gpus", "memory_usage_bytes", "memory_working_set_bytes", "timestamp_micro"}; !reflect.DeepEqual(keys, want) {
				t.Fatalf("metrics keys %v, want %v", keys, want)
			}
			raw, _ := json.Marshal(body["gpus"])
			var got []gpuJSON
			if err := json.Unmarshal(raw, &got); err != nil || got == nil {
				t.Fatalf("gpus %s: want a list (%v)", raw, err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("gpus %s, want %v", raw, tc.want)
			}
			if len(tc.want) == 0 {
				logs, _ := testenv.Docker(context.Background(), "logs", h.container)
				if n := strings.Count(logs, "no GPU metrics"); n != 1 {
					t.Fatalf("three metrics calls logged %d lines of no GPU metrics, want 1:\n%s", n, logs)
				}
			}
		})
	}
}

// getMetrics reads /api/metrics as raw JSON: the keys are what is checked.
func getMetrics(t *testing.T, h *runnerHarness) map[string]any {
	t.Helper()
	out, err := testenv.Docker(context.Background(), "inspect", "-f", "{{json .Args}}", h.container)
	if err != nil {
		t.Fatal(err)
	}
	var args []string
	if err := json.Unmarshal([]byte(out), &args); err != nil {
		t.Fatalf("runner args %q: %v", out, err)
	}
	i := slices.Index(args, "--http-port")
	if i < 0 || i+1 >= len(args) {
		t.Fatalf("runner args %q have no --http-port", args)
	}
	resp, err := http.Get("http://127.0.0.1:" + args[i+1] + "/api/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/api/metrics: %d %s", resp.StatusCode, b)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("/api/metrics: %v: %s", err, b)
	}
	return m
}
