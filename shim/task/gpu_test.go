package task

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/tandem-run/tandem/api"
)

func TestGPUWiringPerVendor(t *testing.T) {
	ids := []string{"GPU-a", "GPU-b"}
	tests := []struct {
		name   string
		vendor api.GPUVendor
		cdi    bool
		check  func(t *testing.T, s ContainerSpec)
	}{
		{"nvidia hook", api.GPUVendorNVIDIA, false, func(t *testing.T, s ContainerSpec) {
			if s.GPUs == nil || s.GPUs.Driver != "" || !slices.Equal(s.GPUs.DeviceIDs, ids) || !slices.Contains(s.GPUs.Capabilities, "display") || len(s.GPUs.Capabilities) != 7 {
				t.Fatalf("%+v", s.GPUs)
			}
		}},
		{"nvidia cdi", api.GPUVendorNVIDIA, true, func(t *testing.T, s ContainerSpec) {
			if s.GPUs == nil || s.GPUs.Driver != "cdi" || !slices.Equal(s.GPUs.DeviceIDs, []string{"nvidia.com/gpu=GPU-a", "nvidia.com/gpu=GPU-b"}) {
				t.Fatalf("%+v", s.GPUs)
			}
		}},
		{"amd", api.GPUVendorAMD, false, func(t *testing.T, s ContainerSpec) {
			if s.GPUs != nil || s.IpcMode != "host" || !slices.Equal(s.CapAdd, []string{"SYS_PTRACE"}) || !slices.Equal(s.SecurityOpt, []string{"seccomp=unconfined"}) ||
				len(s.Devices) != 3 || s.Devices[0].Host != "/dev/kfd" || s.Devices[1].Host != "GPU-a" {
				t.Fatalf("%+v", s)
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e, _ := newEngine(t, newStepRuntime())
			e.cfg.GPUVendor, e.cfg.NvidiaCDI = tc.vendor, tc.cdi
			cfg := normalize(api.TaskConfig{ID: "t", Name: "n", ImageName: "i"})
			tc.check(t, e.containerSpec(&task{cfg: cfg, name: "n-1"}, "/r", ids))
		})
	}
}

// Gaudi and Tenstorrent tasks get dstack's wiring; a passed-through
// HABANA_VISIBLE_DEVICES never shadows the shim's (it would give the task
// every card, or another task's), and Tenstorrent's nodes come from the
// host root.
func TestGPUWiringGaudiTenstorrent(t *testing.T) {
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "dev", "hugepages-1G"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		vendor api.GPUVendor
		ids    []string
		check  func(t *testing.T, s ContainerSpec)
	}{
		{api.GPUVendorIntel, []string{"2", "3"}, func(t *testing.T, s ContainerSpec) {
			var habana []string
			for _, kv := range s.Env {
				if strings.HasPrefix(kv, "HABANA_VISIBLE_DEVICES=") {
					habana = append(habana, kv)
				}
			}
			if s.Runtime != "habana" || s.IpcMode != "host" || !slices.Equal(s.CapAdd, []string{"SYS_NICE"}) || s.GPUs != nil ||
				!slices.Equal(habana, []string{"HABANA_VISIBLE_DEVICES=2,3"}) || !slices.Contains(s.Env, "KEEP=1") {
				t.Fatalf("%+v", s)
			}
		}},
		{api.GPUVendorTenstorrent, []string{"1"}, func(t *testing.T, s ContainerSpec) {
			if s.Runtime != "" || s.IpcMode != "" || len(s.Devices) != 1 ||
				s.Devices[0] != (Device{Host: filepath.Join(root, "dev/tenstorrent/1"), Container: "/dev/tenstorrent/1", Perms: "rwm"}) ||
				!slices.Contains(s.Binds, Bind{Source: filepath.Join(root, "dev/hugepages-1G"), Target: "/dev/hugepages-1G"}) {
				t.Fatalf("%+v", s)
			}
		}},
	} {
		t.Run(string(tc.vendor), func(t *testing.T) {
			e, _ := newEngine(t, newStepRuntime())
			e.cfg.GPUVendor, e.cfg.GPUHostRoot = tc.vendor, root
			e.cfg.Env = []string{"HABANA_VISIBLE_DEVICES=all", "KEEP=1"}
			cfg := normalize(api.TaskConfig{ID: "t", Name: "n", ImageName: "i"})
			tc.check(t, e.containerSpec(&task{cfg: cfg, name: "n-1"}, "/r", tc.ids))
		})
	}
}

// modesetRuntime fails the first start like Docker on a headless host.
type modesetRuntime struct {
	*stepRuntime
	mu     sync.Mutex
	specs  []ContainerSpec
	starts int
}

func (m *modesetRuntime) Create(ctx context.Context, s ContainerSpec) (string, error) {
	m.mu.Lock()
	m.specs = append(m.specs, s)
	m.mu.Unlock()
	return m.stepRuntime.Create(ctx, s)
}

func (m *modesetRuntime) Start(ctx context.Context, id string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.starts++
	if m.starts == 1 {
		return fmt.Errorf("%w: error running hook: nvidia-container-cli: mount error: stat failed: /dev/nvidia-modeset: no such file or directory", ErrNoModeset)
	}
	return nil
}

func TestModesetRetryWithoutDisplay(t *testing.T) {
	rt := &modesetRuntime{stepRuntime: newStepRuntime()}
	e, _ := newEngine(t, rt, "GPU-a")
	e.cfg.GPUVendor = api.GPUVendorNVIDIA
	if _, err := e.Submit(api.TaskConfig{ID: "t", Name: "n", ImageName: "img", GPU: 1}); err != nil {
		t.Fatal(err)
	}
	info := waitStatus(t, e, "t", api.TaskRunning)
	rt.mu.Lock()
	defer rt.mu.Unlock()
	if len(rt.specs) != 2 || !slices.Contains(rt.specs[0].GPUs.Capabilities, "display") || slices.Contains(rt.specs[1].GPUs.Capabilities, "display") {
		t.Fatalf("specs %+v", rt.specs)
	}
	if rt.live() != 1 || info.ContainerID == "" {
		t.Fatalf("the failed container must be removed and the new id recorded: live=%d %+v", rt.live(), info)
	}
}

// modeRuntime answers GPUMode as told and counts the questions.
type modeRuntime struct {
	*stepRuntime
	mode  string
	err   error
	asked int
}

func (m *modeRuntime) GPUMode(context.Context) (string, error) { m.asked++; return m.mode, m.err }

// TestNvidiaModeLearnedFromRuntime: without a configured mode the engine
// asks the runtime on the first GPU task and keeps a real answer; an error
// means the runtime hook, asked again next time.
func TestNvidiaModeLearnedFromRuntime(t *testing.T) {
	rt := &modeRuntime{stepRuntime: newStepRuntime(), err: fmt.Errorf("docker down")}
	e, _ := newEngine(t, rt)
	e.cfg.GPUVendor = api.GPUVendorNVIDIA
	spec := func() ContainerSpec {
		return e.containerSpec(&task{cfg: api.TaskConfig{ID: "x", Name: "x", ImageName: "img", GPU: 1}, name: "n-1"}, "/r", []string{"GPU-a"})
	}
	if s := spec(); s.GPUs == nil || s.GPUs.Driver != "" {
		t.Fatalf("docker down: want the runtime hook, got %+v", s.GPUs)
	}
	rt.mode, rt.err = "cdi", nil
	for range 2 {
		if s := spec(); s.GPUs == nil || s.GPUs.Driver != "cdi" {
			t.Fatalf("cdi: %+v", s.GPUs)
		}
	}
	if rt.asked != 2 {
		t.Fatalf("asked the runtime %d times, want 2 (once failing, once answering)", rt.asked)
	}
}
