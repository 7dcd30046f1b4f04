//go:build cgo

package gpu

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/internal/gpufixture"
)

// devNodes writes a /dev fixture: plain files stand for the device nodes,
// which the monitor only lists.
func devNodes(t *testing.T, names ...string) string {
	t.Helper()
	dev := t.TempDir()
	for _, n := range names {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dev, n)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dev, n), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dev
}

func nvidiaDev(t *testing.T, n int) string {
	names := []string{"nvidiactl", "nvidia-uvm", "nvidia-modeset"}
	for i := 0; i < n; i++ {
		names = append(names, fmt.Sprintf("nvidia%d", i))
	}
	return devNodes(t, names...)
}

// healthyDGX is the DGX mock with every health query answering well.
func healthyDGX(t testing.TB) (*NVML, *dgxa100.Server, []GPU) {
	src, srv := dgx(t)
	for _, d := range srv.Devices {
		d := d.(*dgxa100.Device)
		d.GetRetiredPagesPendingStatusFunc = func() (nvml.EnableState, nvml.Return) { return nvml.FEATURE_DISABLED, nvml.SUCCESS }
		d.GetRemappedRowsFunc = func() (int, int, bool, bool, nvml.Return) { return 0, 0, false, false, nvml.SUCCESS }
		d.GetTotalEccErrorsFunc = func(nvml.MemoryErrorType, nvml.EccCounterType) (uint64, nvml.Return) { return 0, nvml.SUCCESS }
		d.GetCurrentClocksEventReasonsFunc = func() (uint64, nvml.Return) { return 0, nvml.SUCCESS }
	}
	gpus, err := Discover(context.Background(), logging.Discard(), src)
	if err != nil || len(gpus) != 8 {
		t.Fatalf("%d %v", len(gpus), err)
	}
	return src, srv, gpus
}

func first(h *api.DCGMHealth) string {
	if h == nil || len(h.Incidents) == 0 {
		return ""
	}
	return h.Incidents[0].ErrorMessage
}

func allMessages(h *api.DCGMHealth) string {
	var b strings.Builder
	for _, in := range h.Incidents {
		b.WriteString(in.ErrorMessage + "|")
	}
	return b.String()
}

// A host with NVIDIA device nodes whose NVML fails is a failure whose first
// incident says what and how to fix it; the same NVML failure on a host
// without nodes (no NVIDIA card) is no incident.
func TestHealthNodesButNVMLFails(t *testing.T) {
	for _, tc := range []struct {
		name  string
		ret   nvml.Return
		nodes int
		want  []string // in the first incident; none: null health
	}{
		{"driver not loaded", nvml.ERROR_DRIVER_NOT_LOADED, 8, []string{"8 NVIDIA GPU device nodes (/dev/nvidia0 to /dev/nvidia7)", "the NVIDIA kernel driver is not loaded", "modprobe nvidia", "restart dstack-shim"}},
		{"no library", nvml.ERROR_LIBRARY_NOT_FOUND, 1, []string{"an NVIDIA GPU device node (/dev/nvidia0)", "libnvidia-ml.so.1 not found"}},
		{"vGPU the driver rejects", nvml.ERROR_UNKNOWN, 2, []string{"2 NVIDIA GPU device nodes", "NVML init: ERROR_UNKNOWN"}},
		{"no nodes, no NVIDIA", nvml.ERROR_LIBRARY_NOT_FOUND, 0, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lib := &mock.Interface{InitFunc: func() nvml.Return { return tc.ret }}
			src := &NVML{Lib: lib}
			gpus, err := Discover(context.Background(), logging.Discard(), src)
			if err != nil || len(gpus) != 0 {
				t.Fatalf("%v %v", gpus, err)
			}
			m := &Monitor{DevRoot: nvidiaDev(t, tc.nodes), SysRoot: t.TempDir(), GPUs: gpus, NVML: src, Locks: NewLocksFor(gpus)}
			m.CheckHost()
			h := m.Health()
			if tc.want == nil {
				if h != nil {
					t.Fatalf("want null, got %+v", h)
				}
				return
			}
			if h == nil || h.OverallHealth != api.HealthFail || h.Incidents[0].Health != api.HealthFail {
				t.Fatalf("want a failure, got %+v", h)
			}
			for _, w := range tc.want {
				if !strings.Contains(first(h), w) {
					t.Fatalf("first incident %q lacks %q", first(h), w)
				}
			}
		})
	}
}

// A GPU whose health turns critical is out of allocation, the others are
// not, and the host stays schedulable (a warning); its recovery brings it
// back. Each change is logged once.
func TestHealthCriticalGPUIsTakenOutOfAllocation(t *testing.T) {
	src, srv, gpus := healthyDGX(t)
	var logs bytes.Buffer
	locks := NewLocksFor(gpus)
	xids := map[string][]uint64{}
	m := &Monitor{DevRoot: nvidiaDev(t, 8), SysRoot: t.TempDir(), GPUs: gpus, NVML: src, Locks: locks,
		XIDs: func() map[string][]uint64 { return xids }, Log: slog.New(slog.NewTextHandler(&logs, nil))}
	m.CheckHost()
	if h := m.Health(); h == nil || h.OverallHealth != api.HealthPass || len(h.Incidents) != 0 || locks.Free() != 8 {
		t.Fatalf("healthy: %+v free %d", h, locks.Free())
	}
	holder, _ := locks.Acquire("holder", 1) // GPU 0
	// Double-bit ECC on GPU 5, a failed row remap on GPU 2, XID 79 on GPU 7,
	// GPU 3 lost to NVML; GPU 1 only throttles (a warning, still given).
	srv.Devices[5].(*dgxa100.Device).GetTotalEccErrorsFunc = func(typ nvml.MemoryErrorType, _ nvml.EccCounterType) (uint64, nvml.Return) {
		if typ == nvml.MEMORY_ERROR_TYPE_UNCORRECTED {
			return 2, nvml.SUCCESS
		}
		return 0, nvml.SUCCESS
	}
	srv.Devices[2].(*dgxa100.Device).GetRemappedRowsFunc = func() (int, int, bool, bool, nvml.Return) { return 0, 1, false, true, nvml.SUCCESS }
	d3 := srv.Devices[3].(*dgxa100.Device)
	d3.GetRetiredPagesPendingStatusFunc = func() (nvml.EnableState, nvml.Return) { return 0, nvml.ERROR_GPU_IS_LOST }
	d3.GetRemappedRowsFunc = func() (int, int, bool, bool, nvml.Return) { return 0, 0, false, false, nvml.ERROR_GPU_IS_LOST }
	srv.Devices[1].(*dgxa100.Device).GetCurrentClocksEventReasonsFunc = func() (uint64, nvml.Return) {
		return nvml.ClocksThrottleReasonHwThermalSlowdown, nvml.SUCCESS
	}
	xids[gpus[7].ID] = []uint64{79}
	xids[gpus[0].ID] = []uint64{79} // the held GPU fails too: its task keeps it
	m.CheckHost()
	m.CheckHost() // no change: no second log line
	h := m.Health()
	if h.OverallHealth != api.HealthWarn {
		t.Fatalf("some GPUs left: the host is a warning the server schedules onto, got %+v", h)
	}
	msgs := allMessages(h)
	for _, want := range []string{
		"GPU 5: 2 uncorrectable ECC errors since boot; taken out of allocation",
		"GPU 2: row remapping failed; taken out of allocation",
		"GPU 7: XID 79: GPU has fallen off the bus; taken out of allocation",
		"GPU 3: GPU has fallen off the bus (NVML: GPU is lost); taken out of allocation",
		"GPU 1: clocks throttled by temperature|",
	} {
		if !strings.Contains(msgs, want) {
			t.Fatalf("missing %q in %s", want, msgs)
		}
	}
	if strings.Count(msgs, "GPU 3: GPU has fallen off the bus") != 1 {
		t.Fatalf("one lost GPU is one incident: %s", msgs)
	}
	if got, err := locks.Acquire("big", 4); !errors.Is(err, ErrNoCapacity) {
		t.Fatalf("3 GPUs are left (1, 4, 6): %v %v", idx(gpus, got), err)
	}
	got, err := locks.Acquire("t", 3)
	if err != nil || idx(gpus, got) != "[1 4 6]" {
		t.Fatalf("healthy ones: %v %v", idx(gpus, got), err)
	}
	locks.Release("t", got)
	if err := locks.Lock("holder", holder); err != nil {
		t.Fatalf("the holding task keeps its GPU: %v", err)
	}
	if n := strings.Count(logs.String(), "GPU taken out of allocation"); n != 5 {
		t.Fatalf("each change logged once: %d lines\n%s", n, logs.String())
	}
	// GPU 5 is reset: its volatile counter is 0 again, and it is back.
	srv.Devices[5].(*dgxa100.Device).GetTotalEccErrorsFunc = func(nvml.MemoryErrorType, nvml.EccCounterType) (uint64, nvml.Return) { return 0, nvml.SUCCESS }
	m.CheckHost()
	if _, ok := locks.Excluded()[gpus[5].ID]; ok || !strings.Contains(logs.String(), "GPU back in allocation") {
		t.Fatalf("reset GPU still excluded: %v", locks.Excluded())
	}
	// Every GPU failing leaves nothing to give: the host fails.
	for _, g := range gpus {
		xids[g.ID] = []uint64{48}
	}
	m.CheckHost()
	if h := m.Health(); h.OverallHealth != api.HealthFail || !strings.Contains(first(h), "all 8 GPUs of this host are out of allocation") {
		t.Fatalf("no GPU left: %+v", h)
	}
}

// A card that NVML no longer lists, or whose node went, is a failure of the
// host and out of allocation.
func TestHealthGPUVanished(t *testing.T) {
	src, srv, gpus := healthyDGX(t)
	dev := nvidiaDev(t, 8)
	locks := NewLocksFor(gpus)
	m := &Monitor{DevRoot: dev, SysRoot: t.TempDir(), GPUs: gpus, NVML: src, Locks: locks}
	m.CheckHost()
	// GPU 6 is gone from NVML: 7 devices, the last one moved up.
	left := append(slices.Clone(srv.Devices[:6]), srv.Devices[7])
	srv.DeviceGetCountFunc = func() (int, nvml.Return) { return len(left), nvml.SUCCESS }
	srv.DeviceGetHandleByIndexFunc = func(i int) (nvml.Device, nvml.Return) {
		if i < 0 || i >= len(left) {
			return nil, nvml.ERROR_INVALID_ARGUMENT
		}
		return left[i], nvml.SUCCESS
	}
	if err := os.Remove(filepath.Join(dev, "nvidia6")); err != nil {
		t.Fatal(err)
	}
	m.CheckHost()
	h := m.Health()
	if h.OverallHealth != api.HealthFail || !strings.Contains(first(h), "GPU 6 ("+gpus[6].ID+") has vanished since the shim started") {
		t.Fatalf("vanished: %+v", h)
	}
	if !strings.Contains(allMessages(h), "8 NVIDIA GPU device nodes were there at the shim's start, 7 are now") {
		t.Fatalf("node gone: %s", allMessages(h))
	}
	if _, ok := locks.Excluded()[gpus[6].ID]; !ok || locks.Free() != 7 {
		t.Fatalf("vanished GPU allocatable: %v", locks.Excluded())
	}
}

// NVML gives fewer GPUs than the host has nodes: a task asking for all of
// them cannot start, and the host says so.
func TestHealthFewerGPUsThanNodes(t *testing.T) {
	src, _, gpus := healthyDGX(t)
	m := &Monitor{DevRoot: nvidiaDev(t, 9), SysRoot: t.TempDir(), GPUs: gpus, NVML: src, Locks: NewLocksFor(gpus)}
	m.CheckHost()
	if h := m.Health(); h.OverallHealth != api.HealthFail || !strings.Contains(first(h), "9 NVIDIA GPU device nodes (/dev/nvidia0 to /dev/nvidia8) but NVML gives 8 GPUs") {
		t.Fatalf("%+v", h)
	}
}

// Docker without the NVIDIA runtime, or in CDI mode without a spec naming
// the GPUs, cannot start a GPU task: a failure. A Docker that does not
// answer changes nothing here (its own incident says it).
func TestHealthDockerAccess(t *testing.T) {
	src, _, gpus := healthyDGX(t)
	spec := t.TempDir()
	var b strings.Builder
	b.WriteString("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n")
	for _, g := range gpus {
		fmt.Fprintf(&b, "- name: %s\n", g.ID)
	}
	if err := os.WriteFile(filepath.Join(spec, "nvidia.yaml"), []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		access Access
		err    error
		want   string // first incident; "": healthy
	}{
		{"nvidia runtime", Access{Runtime: true}, nil, ""},
		{"neither runtime nor CDI", Access{}, nil, "Docker has neither the NVIDIA runtime nor CDI"},
		{"CDI without a spec", Access{CDI: true, CDIDirs: []string{t.TempDir()}}, nil, "no CDI spec in"},
		{"CDI with the spec", Access{CDI: true, CDIDirs: []string{spec}}, nil, ""},
		{"Docker does not answer", Access{}, errors.New("connection refused"), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := &Monitor{DevRoot: nvidiaDev(t, 8), SysRoot: t.TempDir(), GPUs: gpus, NVML: src, Locks: NewLocksFor(gpus),
				Access: func(context.Context) (Access, error) { return tc.access, tc.err }}
			m.Check(context.Background())
			h := m.Health()
			if tc.want == "" {
				if h.OverallHealth != api.HealthPass {
					t.Fatalf("%+v", h)
				}
				return
			}
			if h.OverallHealth != api.HealthFail || !strings.Contains(first(h), tc.want) {
				t.Fatalf("first incident %q lacks %q", first(h), tc.want)
			}
			if tc.access.CDI && !strings.Contains(first(h), "GPU 7 ("+gpus[7].ID+")") {
				t.Fatalf("the GPUs are named: %q", first(h))
			}
		})
	}
}

// AMD: /dev/kfd and a discrete card's render node that the sysfs source
// did not give is a failure; an APU's (small VRAM) is not.
func TestHealthAMDNodesButNoGPUs(t *testing.T) {
	for _, tc := range []struct {
		name    string
		vramMiB int64
		fail    bool
	}{
		{"discrete card", 196608, true},
		{"APU", 512, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			gpufixture.AMDCard(t, root, 128, "0000:10:00.0", tc.vramMiB, "AMD Instinct MI300X", 0)
			// no /sys/class/kfd: the sysfs source finds nothing
			gpus, err := Discover(context.Background(), logging.Discard(), AMD{Root: root})
			if err != nil || len(gpus) != 0 {
				t.Fatalf("%v %v", gpus, err)
			}
			dev := devNodes(t, "kfd", "dri/renderD128", "dri/card0")
			m := &Monitor{DevRoot: dev, SysRoot: filepath.Join(root, "sys"), GPUs: gpus, Locks: NewLocksFor(gpus)}
			m.CheckHost()
			h := m.Health()
			if !tc.fail {
				if h != nil {
					t.Fatalf("an APU host is no GPU host: %+v", h)
				}
				return
			}
			if h == nil || h.OverallHealth != api.HealthFail || !strings.Contains(first(h), "/dev/kfd and 1 AMD GPU render nodes (/dev/dri/renderD128) but the shim can use 0") {
				t.Fatalf("%+v", h)
			}
		})
	}
}

// BenchmarkHealthCheckHost8 is one periodic check of an 8-GPU host: the
// /dev listing, NVML's enumeration and each GPU's health queries.
func BenchmarkHealthCheckHost8(b *testing.B) {
	src, _, gpus := healthyDGX(b)
	dev := b.TempDir()
	for i := 0; i < 8; i++ {
		_ = os.WriteFile(filepath.Join(dev, fmt.Sprintf("nvidia%d", i)), nil, 0o644)
	}
	m := &Monitor{DevRoot: dev, SysRoot: b.TempDir(), GPUs: gpus, NVML: src, Locks: NewLocksFor(gpus)}
	b.ReportAllocs()
	for b.Loop() {
		m.CheckHost()
	}
}
