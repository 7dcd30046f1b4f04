package gpu

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/internal/gpufixture"
)

func TestAMDMI300X(t *testing.T) {
	root := t.TempDir()
	gpufixture.KFD(t, root, "6.7.0")
	for i := 0; i < 8; i++ {
		gpufixture.AMDCard(t, root, 128+i*8, fmt.Sprintf("0000:%02x:00.0", 0x10+i), 196608, "AMD Instinct MI300X", i/4)
	}
	gpus, err := Discover(context.Background(), logging.Discard(), AMD{Root: root})
	if err != nil || len(gpus) != 8 {
		t.Fatalf("%v %v", gpus, err)
	}
	for i, g := range gpus {
		if g.ID != fmt.Sprintf("/dev/dri/renderD%d", 128+i*8) || g.MemoryMiB != 196608 || g.Name != "AMD Instinct MI300X" ||
			g.DriverVersion != "6.7.0" || g.Vendor != api.GPUVendorAMD || g.Index != i || g.NUMANode != i/4 || g.PCIBusID != fmt.Sprintf("0000:%02x:00.0", 0x10+i) {
			t.Fatalf("gpu %d: %+v", i, g)
		}
	}
}

// stubSource stands for another vendor's discovery result.
type stubSource struct {
	vendor api.GPUVendor
	gpus   []GPU
	err    error
}

func (s stubSource) Vendor() api.GPUVendor                   { return s.vendor }
func (s stubSource) Discover(context.Context) ([]GPU, error) { return s.gpus, s.err }

func TestMixedHosts(t *testing.T) {
	nvidia := stubSource{vendor: api.GPUVendorNVIDIA, gpus: []GPU{{Vendor: api.GPUVendorNVIDIA, ID: "GPU-1", Name: "H100"}}}
	// An APU's integrated GPU (512 MiB carve-out) next to an NVIDIA card:
	// only the NVIDIA card counts (dstack issue #4085 picked AMD).
	igpu := t.TempDir()
	gpufixture.KFD(t, igpu, "")
	gpufixture.AMDCard(t, igpu, 128, "0000:c1:00.0", 512, "AMD Radeon Graphics", 0)
	gpus, err := Discover(context.Background(), logging.Discard(), nvidia, AMD{Root: igpu})
	if err != nil || len(gpus) != 1 || gpus[0].Vendor != api.GPUVendorNVIDIA {
		t.Fatalf("iGPU + NVIDIA: %v %v", gpus, err)
	}
	// Two discrete vendors: an error that says so, never a silent pick.
	both := t.TempDir()
	gpufixture.KFD(t, both, "")
	gpufixture.AMDCard(t, both, 128, "0000:41:00.0", 65536, "AMD Instinct MI210", 0)
	_, err = Discover(context.Background(), logging.Discard(), nvidia, AMD{Root: both})
	if !errors.Is(err, ErrMixedVendors) || err.Error() != "GPUs of more than one vendor: nvidia and amd; the shim runs one vendor per host" {
		t.Fatalf("mixed: %v", err)
	}
	// A failing source does not hide the other vendor.
	broken := stubSource{vendor: api.GPUVendorNVIDIA, err: errors.New("NVML: unknown error")}
	gpus, err = Discover(context.Background(), logging.Discard(), broken, AMD{Root: both})
	if err != nil || len(gpus) != 1 || gpus[0].Vendor != api.GPUVendorAMD {
		t.Fatalf("broken NVML: %v %v", gpus, err)
	}
}
