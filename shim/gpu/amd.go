package gpu

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/tandem-run/tandem/api"
)

// AMD discovers AMD GPUs from sysfs: render nodes under /sys/class/drm whose
// PCI vendor is 0x1002, with /sys/class/kfd present (the compute driver).
// Integrated GPUs (little dedicated VRAM) are not compute devices and are
// skipped, so an APU next to an NVIDIA card does not make a mixed host.
type AMD struct {
	Root string // "/" in production; a fixture tree in tests
	// MinVRAMMiB below which a card counts as integrated (default 4096).
	MinVRAMMiB int64
}

// Vendor implements Source.
func (a AMD) Vendor() api.GPUVendor { return api.GPUVendorAMD }

func (a AMD) path(p ...string) string { return filepath.Join(append([]string{a.Root}, p...)...) }

func readTrim(p string) string {
	b, err := os.ReadFile(p)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// Discover implements Source.
func (a AMD) Discover(context.Context) ([]GPU, error) {
	if _, err := os.Stat(a.path("sys", "class", "kfd")); err != nil {
		return nil, fmt.Errorf("%w: no /sys/class/kfd (amdgpu compute driver not loaded)", ErrNotPresent)
	}
	minVRAM := a.MinVRAMMiB
	if minVRAM == 0 {
		minVRAM = 4096
	}
	nodes, _ := filepath.Glob(a.path("sys", "class", "drm", "renderD*"))
	sort.Slice(nodes, func(i, j int) bool { return renderNum(nodes[i]) < renderNum(nodes[j]) })
	driver := readTrim(a.path("sys", "module", "amdgpu", "version"))
	var out []GPU
	for _, n := range nodes {
		dev := filepath.Join(n, "device")
		if readTrim(filepath.Join(dev, "vendor")) != "0x1002" {
			continue
		}
		vram, err := strconv.ParseInt(readTrim(filepath.Join(dev, "mem_info_vram_total")), 10, 64)
		if err != nil || vram>>20 < minVRAM {
			continue // integrated or not a compute GPU
		}
		name := readTrim(filepath.Join(dev, "product_name"))
		if name == "" {
			name = "AMD GPU " + readTrim(filepath.Join(dev, "device"))
		}
		busID := ""
		if target, err := os.Readlink(dev); err == nil {
			busID = filepath.Base(target)
		}
		numa := -1
		if v, err := strconv.Atoi(readTrim(filepath.Join(dev, "numa_node"))); err == nil {
			numa = v
		}
		out = append(out, GPU{Vendor: api.GPUVendorAMD, Name: name, MemoryMiB: vram >> 20, ID: "/dev/dri/" + filepath.Base(n),
			Index: len(out), DriverVersion: driver, PCIBusID: busID, NUMANode: numa})
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: no discrete AMD GPU among the render nodes", ErrNotPresent)
	}
	return out, nil
}

func renderNum(p string) int {
	n, _ := strconv.Atoi(strings.TrimPrefix(filepath.Base(p), "renderD"))
	return n
}
