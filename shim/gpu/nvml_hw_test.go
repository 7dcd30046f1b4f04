//go:build cgo

package gpu

import (
	"context"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// TestRealNVML runs only where an NVIDIA driver is loaded (a GPU machine):
// discovery through the real libnvidia-ml must agree with nvidia-smi on
// every GPU's UUID, name, memory and PCI bus id, and health and metrics
// must read real values. Elsewhere NVML init fails and the test skips;
// the mock-based tests above cover the logic.
func TestRealNVML(t *testing.T) {
	n := NewNVML()
	gpus, err := n.Discover(context.Background())
	if err != nil {
		t.Skipf("no NVIDIA GPU here: %v", err)
	}
	defer n.Lib.Shutdown()
	smi, err := exec.Command("nvidia-smi", "--query-gpu=index,uuid,name,memory.total,pci.bus_id", "--format=csv,noheader,nounits").Output()
	if err != nil {
		t.Fatalf("NVML found %d GPUs but nvidia-smi failed: %v", len(gpus), err)
	}
	lines := strings.Split(strings.TrimSpace(string(smi)), "\n")
	if len(lines) != len(gpus) {
		t.Fatalf("NVML found %d GPUs, nvidia-smi %d:\n%s", len(gpus), len(lines), smi)
	}
	for i, line := range lines {
		f := strings.Split(line, ", ")
		if len(f) != 5 {
			t.Fatalf("nvidia-smi line %q", line)
		}
		g := gpus[i]
		mem, _ := strconv.ParseInt(f[3], 10, 64)
		t.Logf("GPU %d: %s %q %d MiB bus %s numa %d driver %s mig %v", g.Index, g.ID, g.Name, g.MemoryMiB, g.PCIBusID, g.NUMANode, g.DriverVersion, g.MIGEnabled)
		if strconv.Itoa(g.Index) != f[0] || g.ID != f[1] || g.Name != f[2] || g.MemoryMiB != mem || g.PCIBusID != strings.ToLower(f[4]) {
			t.Errorf("GPU %d: NVML %+v, nvidia-smi %q", i, g, f)
		}
		if g.DriverVersion == "" {
			t.Errorf("GPU %d: no driver version", i)
		}
	}
	h := n.Health(nil)
	if h == nil {
		t.Fatal("no health after discovery")
	}
	t.Logf("health: overall %d, %d incidents %+v", h.OverallHealth, len(h.Incidents), h.Incidents)
	m := &Metrics{NVML: n, Interval: time.Second}
	text := m.Text([]string{gpus[0].ID})
	t.Logf("metrics for GPU 0:\n%s", text)
	for _, want := range []string{"DCGM_FI_DEV_FB_TOTAL", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE"} {
		if !strings.Contains(text, want+"{") {
			t.Errorf("metrics miss %s", want)
		}
	}
	if !strings.Contains(text, "DCGM_FI_DEV_FB_TOTAL{") || !strings.Contains(text, " "+strconv.FormatInt(gpus[0].MemoryMiB, 10)) {
		t.Errorf("FB_TOTAL does not report %d MiB", gpus[0].MemoryMiB)
	}
	if v, r := n.Lib.SystemGetNVMLVersion(); r == nvml.SUCCESS {
		t.Logf("NVML %s", v)
	}
}
