//go:build cgo

package gpu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/logging"
)

func busIDBytes(s string) [32]int8 {
	var b [32]int8
	for i, c := range s {
		b[i] = int8(c)
	}
	return b
}

// dgx returns go-nvml's 8-GPU DGX A100 mock with PCI bus ids and a sysfs
// fixture putting GPUs 0-3 on NUMA node 0 and 4-7 on node 1.
func dgx(t testing.TB) (*NVML, *dgxa100.Server) {
	t.Helper()
	srv := dgxa100.New()
	sys := t.TempDir()
	for i, d := range srv.Devices {
		id := fmt.Sprintf("00000000:%02X:00.0", 0x10+i*0x10)
		dev := d.(*dgxa100.Device)
		dev.GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) { return nvml.PciInfo{BusId: busIDBytes(id)}, nvml.SUCCESS }
		dir := filepath.Join(sys, "bus", "pci", "devices", pciSysName(id))
		_ = os.MkdirAll(dir, 0o755)
		_ = os.WriteFile(filepath.Join(dir, "numa_node"), []byte(fmt.Sprintf("%d\n", i/4)), 0o644)
	}
	return &NVML{Lib: srv, SysRoot: sys}, srv
}

func TestNVMLDiscoveryAndTopology(t *testing.T) {
	src, srv := dgx(t)
	gpus, err := Discover(context.Background(), logging.Discard(), src, AMD{Root: t.TempDir()})
	if err != nil || len(gpus) != 8 {
		t.Fatalf("%d gpus, %v", len(gpus), err)
	}
	seen := map[string]bool{}
	for i, g := range gpus {
		want := srv.Devices[i].(*dgxa100.Device).UUID
		if g.ID != want || g.Index != i || g.Name != "Mock NVIDIA A100-SXM4-40GB" || g.MemoryMiB != 40960 || g.DriverVersion != "550.54.15" ||
			g.Vendor != api.GPUVendorNVIDIA || g.NUMANode != i/4 || g.MIGEnabled || seen[g.ID] {
			t.Fatalf("gpu %d: %+v", i, g)
		}
		seen[g.ID] = true
	}
	// Allocation keeps a task on one NUMA node when it fits.
	l := NewLocksFor(gpus)
	a, _ := l.Acquire("a", 2) // node 0: 0,1
	b, _ := l.Acquire("b", 4) // node 0 has 2 left: node 1 takes it
	c, _ := l.Acquire("c", 2) // node 0: 2,3
	if a[0] != gpus[0].ID || a[1] != gpus[1].ID || b[0] != gpus[4].ID || b[3] != gpus[7].ID || c[0] != gpus[2].ID {
		t.Fatalf("placement a=%v b=%v c=%v", idx(gpus, a), idx(gpus, b), idx(gpus, c))
	}
	l.Release("a", a)
	l.Release("c", c)
	d, _ := l.Acquire("d", 3) // only node 0 has 4 free now
	if idx(gpus, d) != "[0 1 2]" {
		t.Fatalf("d=%v", idx(gpus, d))
	}
}

func idx(gpus []GPU, ids []string) string {
	var out []int
	for _, id := range ids {
		for _, g := range gpus {
			if g.ID == id {
				out = append(out, g.Index)
			}
		}
	}
	return fmt.Sprint(out)
}

func TestNVMLWithoutLibraryIsAnHonestEmptyList(t *testing.T) {
	lib := &mock.Interface{InitFunc: func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND }}
	gpus, err := Discover(context.Background(), logging.Discard(), &NVML{Lib: lib}, AMD{Root: t.TempDir()})
	if err != nil || gpus == nil || len(gpus) != 0 {
		t.Fatalf("%v %v", gpus, err)
	}
	if _, err := (&NVML{Lib: lib}).Discover(context.Background()); !errors.Is(err, ErrNotPresent) || !strings.Contains(err.Error(), "libnvidia-ml.so.1 not found") {
		t.Fatalf("reason: %v", err)
	}
}

func TestConcurrentAcquirersNeverShare(t *testing.T) {
	src, _ := dgx(t)
	gpus, _ := src.Discover(context.Background())
	l := NewLocksFor(gpus)
	var mu sync.Mutex
	owner := map[string]string{}
	var wg sync.WaitGroup
	for i := 0; i < 16; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			task := fmt.Sprint("t", i)
			ids, err := l.Acquire(task, 1)
			if err != nil {
				return
			}
			mu.Lock()
			defer mu.Unlock()
			for _, id := range ids {
				if prev, ok := owner[id]; ok {
					t.Errorf("%s given to %s and %s", id, prev, task)
				}
				owner[id] = task
			}
		}(i)
	}
	wg.Wait()
	if len(owner) != 8 || l.Free() != 0 {
		t.Fatalf("owners %d free %d", len(owner), l.Free())
	}
}

func TestNVMLHealth(t *testing.T) {
	src, srv := dgx(t)
	gpus, _ := src.Discover(context.Background())
	healthy := func(d *dgxa100.Device) {
		d.GetRetiredPagesPendingStatusFunc = func() (nvml.EnableState, nvml.Return) { return nvml.FEATURE_DISABLED, nvml.SUCCESS }
		d.GetRemappedRowsFunc = func() (int, int, bool, bool, nvml.Return) { return 0, 0, false, false, nvml.SUCCESS }
		d.GetTotalEccErrorsFunc = func(nvml.MemoryErrorType, nvml.EccCounterType) (uint64, nvml.Return) { return 0, nvml.SUCCESS }
		d.GetCurrentClocksEventReasonsFunc = func() (uint64, nvml.Return) { return 0, nvml.SUCCESS }
	}
	for _, d := range srv.Devices {
		healthy(d.(*dgxa100.Device))
	}
	h := src.Health(nil)
	if h == nil || h.OverallHealth != 0 || len(h.Incidents) != 0 {
		t.Fatalf("healthy host: %+v", h)
	}
	d2, d5 := srv.Devices[2].(*dgxa100.Device), srv.Devices[5].(*dgxa100.Device)
	d2.GetRetiredPagesPendingStatusFunc = func() (nvml.EnableState, nvml.Return) { return nvml.FEATURE_ENABLED, nvml.SUCCESS }
	d2.GetCurrentClocksEventReasonsFunc = func() (uint64, nvml.Return) { return nvml.ClocksThrottleReasonHwThermalSlowdown, nvml.SUCCESS }
	h = src.Health(nil)
	if h.OverallHealth != 10 || len(h.Incidents) != 2 || h.Incidents[0].EntityID != 2 || h.Incidents[0].Health != 10 {
		t.Fatalf("warnings: %+v", h)
	}
	d5.GetTotalEccErrorsFunc = func(typ nvml.MemoryErrorType, _ nvml.EccCounterType) (uint64, nvml.Return) {
		if typ == nvml.MEMORY_ERROR_TYPE_UNCORRECTED {
			return 3, nvml.SUCCESS
		}
		return 0, nvml.SUCCESS
	}
	h = src.Health(map[string][]uint64{gpus[7].ID: {79, 13}})
	if h.OverallHealth != 20 {
		t.Fatalf("failures: %+v", h)
	}
	var msgs []string
	for _, in := range h.Incidents {
		if in.Health != 0 && in.Health != 10 && in.Health != 20 {
			t.Fatalf("health value outside the server's enum: %+v", in)
		}
		msgs = append(msgs, in.ErrorMessage)
	}
	got := strings.Join(msgs, "|")
	for _, want := range []string{"GPU 5: 3 uncorrectable ECC errors since boot", "GPU 7: XID 79: GPU has fallen off the bus", "GPU 2: clocks throttled by temperature"} {
		if !strings.Contains(got, want) {
			t.Fatalf("missing %q in %s", want, got)
		}
	}
	if strings.Contains(got, "XID 13") {
		t.Fatal("non-critical XIDs are not incidents")
	}
}

func TestNVMLMetricsText(t *testing.T) {
	src, srv := dgx(t)
	gpus, _ := src.Discover(context.Background())
	calls := 0
	for i, d := range srv.Devices {
		dev := d.(*dgxa100.Device)
		i := i
		dev.GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) {
			calls++
			return nvml.Utilization{Gpu: uint32(10 * i)}, nvml.SUCCESS
		}
		dev.GetMemoryInfoFunc = func() (nvml.Memory, nvml.Return) { return nvml.Memory{Total: 40 << 30, Used: 1 << 30}, nvml.SUCCESS }
		dev.GetPowerUsageFunc = func() (uint32, nvml.Return) { return 250500, nvml.SUCCESS }
		dev.GetTemperatureFunc = func(nvml.TemperatureSensors) (uint32, nvml.Return) { return 55, nvml.SUCCESS }
		dev.GetClockInfoFunc = func(nvml.ClockType) (uint32, nvml.Return) { return 1410, nvml.SUCCESS }
		// ECC left unset: a missing reading drops that field only.
	}
	now := time.Unix(0, 0)
	m := &Metrics{NVML: src, Interval: 5 * time.Second, Now: func() time.Time { return now }}
	text := m.Text([]string{gpus[3].ID, gpus[6].ID})
	for _, want := range []string{
		"# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n",
		fmt.Sprintf("DCGM_FI_DEV_GPU_UTIL{gpu=\"3\",UUID=\"%s\",device=\"nvidia3\",modelName=\"Mock NVIDIA A100-SXM4-40GB\"} 30\n", gpus[3].ID),
		fmt.Sprintf("DCGM_FI_DEV_GPU_UTIL{gpu=\"6\",UUID=\"%s\",device=\"nvidia6\",modelName=\"Mock NVIDIA A100-SXM4-40GB\"} 60\n", gpus[6].ID),
		"DCGM_FI_DEV_POWER_USAGE{gpu=\"3\"", "} 250.5\n", "DCGM_FI_DEV_FB_USED{gpu=\"6\"", "} 1024\n", "DCGM_FI_DEV_SM_CLOCK{gpu=\"3\"",
	} {
		if !strings.Contains(text, want) {
			t.Fatalf("missing %q in:\n%s", want, text)
		}
	}
	if strings.Contains(text, gpus[0].ID) || strings.Contains(text, "ECC") {
		t.Fatalf("other GPUs or unread fields leaked:\n%s", text)
	}
	first := calls
	_ = m.Text([]string{gpus[1].ID})
	if calls != first {
		t.Fatal("NVML must be read at most once per interval")
	}
	now = now.Add(6 * time.Second)
	_ = m.Text([]string{gpus[1].ID})
	if calls == first {
		t.Fatal("a new interval reads again")
	}
	if m.Text(nil) != "" {
		t.Fatal("a task without GPUs has an empty body")
	}
}

func BenchmarkDiscovery8(b *testing.B) {
	fixture, _ := dgx(b)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		src := &NVML{Lib: fixture.Lib, SysRoot: fixture.SysRoot} // a fresh Init each time
		if gpus, err := src.Discover(context.Background()); err != nil || len(gpus) != 8 {
			b.Fatal(err)
		}
	}
}

func BenchmarkTaskMetrics8(b *testing.B) {
	src, srv := dgx(b)
	gpus, _ := src.Discover(context.Background())
	for _, d := range srv.Devices {
		dev := d.(*dgxa100.Device)
		dev.GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) { return nvml.Utilization{Gpu: 50}, nvml.SUCCESS }
		dev.GetPowerUsageFunc = func() (uint32, nvml.Return) { return 250000, nvml.SUCCESS }
		dev.GetTemperatureFunc = func(nvml.TemperatureSensors) (uint32, nvml.Return) { return 55, nvml.SUCCESS }
		dev.GetClockInfoFunc = func(nvml.ClockType) (uint32, nvml.Return) { return 1410, nvml.SUCCESS }
		dev.GetTotalEccErrorsFunc = func(nvml.MemoryErrorType, nvml.EccCounterType) (uint64, nvml.Return) { return 0, nvml.SUCCESS }
	}
	ids := make([]string, 0, 8)
	for _, g := range gpus {
		ids = append(ids, g.ID)
	}
	m := &Metrics{NVML: src, Interval: 0} // read NVML every time: the worst case
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if m.Text(ids) == "" {
			b.Fatal("empty")
		}
	}
}
