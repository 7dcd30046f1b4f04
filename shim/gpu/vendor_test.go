package gpu

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/internal/gpufixture"
)

// TestVendorOrder (dstack #4085, #4116): which vendor a host is, on
// fixture trees, with every source the shim runs (NVML stands as a stub:
// it answers or not). Each sysfs source claims only its own vendor's
// discrete cards, so an iGPU, another vendor's NPU under /dev/accel or a
// WSL2 host's paths never make a second vendor, and the order of the
// sources changes nothing.
func TestVendorOrder(t *testing.T) {
	h100 := stubSource{vendor: api.GPUVendorNVIDIA, gpus: []GPU{{Vendor: api.GPUVendorNVIDIA, ID: "GPU-1", Name: "NVIDIA H100"}}}
	noNVML := stubSource{vendor: api.GPUVendorNVIDIA, err: ErrNotPresent}
	igpu := func(t testing.TB, root string) {
		gpufixture.KFD(t, root, "")
		gpufixture.AMDCard(t, root, 128, "0000:c1:00.0", 512, "AMD Radeon 780M", 0)
	}
	npu := func(t testing.TB, root string) { gpufixture.OtherNPU(t, root, 8, "0000:00:0b.0") }
	wsl := func(t testing.TB, root string) {
		for _, p := range []string{"dev/dxg", "usr/lib/wsl/lib/nvidia-smi"} {
			_ = os.MkdirAll(filepath.Dir(filepath.Join(root, p)), 0o755)
			if err := os.WriteFile(filepath.Join(root, p), nil, 0o755); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, tc := range []struct {
		name   string
		nvml   Source
		build  []func(testing.TB, string)
		vendor api.GPUVendor // "" none
		count  int
		mixed  bool
	}{
		{"AMD iGPU and an NVIDIA card", h100, []func(testing.TB, string){igpu}, api.GPUVendorNVIDIA, 1, false},
		{"an Intel NPU and an NVIDIA card", h100, []func(testing.TB, string){npu}, api.GPUVendorNVIDIA, 1, false},
		{"an Intel NPU alone is not Gaudi", noNVML, []func(testing.TB, string){npu}, "", 0, false},
		{"NVIDIA on WSL2", h100, []func(testing.TB, string){wsl}, api.GPUVendorNVIDIA, 1, false},
		{"WSL2 paths without NVML", noNVML, []func(testing.TB, string){wsl}, "", 0, false},
		{"Gaudi beside an NPU and an iGPU", noNVML, []func(testing.TB, string){npu, igpu, gpufixture.Gaudi2Host}, api.GPUVendorIntel, 8, false},
		{"Tenstorrent beside an iGPU", noNVML, []func(testing.TB, string){igpu, func(t testing.TB, r string) { gpufixture.TenstorrentHost(t, r, "n300", 2) }}, api.GPUVendorTenstorrent, 2, false},
		{"AMD dGPU beside an NPU", noNVML, []func(testing.TB, string){npu, func(t testing.TB, r string) {
			gpufixture.KFD(t, r, "")
			gpufixture.AMDCard(t, r, 129, "0000:41:00.0", 65536, "AMD Instinct MI210", 0)
		}}, api.GPUVendorAMD, 1, false},
		{"Gaudi and an NVIDIA card", h100, []func(testing.TB, string){gpufixture.Gaudi2Host}, "", 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			for _, b := range tc.build {
				b(t, root)
			}
			sources := []Source{tc.nvml, Tenstorrent{Root: root}, AMD{Root: root}, Gaudi{Root: root, HLSMI: filepath.Join(root, "no-hl-smi")}}
			for _, order := range [][]Source{sources, {sources[3], sources[2], sources[1], sources[0]}} {
				gpus, err := Discover(context.Background(), logging.Discard(), order...)
				if tc.mixed {
					if !errors.Is(err, ErrMixedVendors) {
						t.Fatalf("mixed: %v %v", gpus, err)
					}
					continue
				}
				if err != nil || len(gpus) != tc.count || (tc.count > 0 && gpus[0].Vendor != tc.vendor) {
					t.Fatalf("got %d %v, want %d of %q", len(gpus), err, tc.count, tc.vendor)
				}
			}
		})
	}
}
