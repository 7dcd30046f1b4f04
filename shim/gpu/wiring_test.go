package gpu

import (
	"slices"
	"testing"

	"github.com/tandem-run/tandem/api"
)

// Wire and IDsFromContainer are inverses for every vendor and mode.
func TestWiringRoundTrip(t *testing.T) {
	tests := []struct {
		vendor api.GPUVendor
		ids    []string
		cdi    bool
	}{
		{api.GPUVendorNVIDIA, []string{"GPU-a", "GPU-b"}, false},
		{api.GPUVendorNVIDIA, []string{"GPU-a"}, true},
		{api.GPUVendorAMD, []string{"/dev/dri/renderD128", "/dev/dri/renderD129"}, false},
	}
	for _, tc := range tests {
		w := Wire(tc.vendor, tc.ids, tc.cdi)
		var reqIDs []string
		if w.Request != nil {
			reqIDs = w.Request.DeviceIDs
		}
		if got := IDsFromContainer(reqIDs, w.Devices); !slices.Equal(got, tc.ids) {
			t.Errorf("%s cdi=%v: decoded %v from %+v", tc.vendor, tc.cdi, got, w)
		}
	}
	w := Wire(api.GPUVendorNVIDIA, []string{"GPU-a"}, false)
	if !HasDisplay(w.Request) || HasDisplay(WithoutDisplay(w.Request)) || !HasDisplay(w.Request) {
		t.Fatal("WithoutDisplay must drop display without touching the original")
	}
	if w := Wire(api.GPUVendorAMD, []string{"/dev/dri/renderD128"}, false); !w.IpcHost || w.Devices[0] != "/dev/kfd" {
		t.Fatalf("amd: %+v", w)
	}
}
