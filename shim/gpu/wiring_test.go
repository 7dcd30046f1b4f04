package gpu

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/tandem-run/tandem/api"
)

// seen is what Docker reports back of a container created from w (as
// dockerrt's inspect passes it on).
func seen(w Wiring) Seen {
	s := Seen{Devices: w.Devices, Env: w.Env, Runtime: w.Runtime}
	if w.Request != nil {
		s.RequestIDs = w.Request.DeviceIDs
	}
	return s
}

// Wire and IDsFromContainer are inverses for every vendor and mode.
func TestWiringRoundTrip(t *testing.T) {
	fixture := t.TempDir()
	tests := []struct {
		vendor api.GPUVendor
		ids    []string
		host   Host
	}{
		{api.GPUVendorNVIDIA, []string{"GPU-a", "GPU-b"}, Host{}},
		{api.GPUVendorNVIDIA, []string{"GPU-a"}, Host{CDI: true}},
		{api.GPUVendorAMD, []string{"/dev/dri/renderD128", "/dev/dri/renderD129"}, Host{}},
		{api.GPUVendorIntel, []string{"0", "3", "7"}, Host{}},
		{api.GPUVendorTenstorrent, []string{"0", "1"}, Host{}},
		{api.GPUVendorTenstorrent, []string{"2"}, Host{Root: fixture}},
	}
	for _, tc := range tests {
		w := tc.host.Wire(tc.vendor, tc.ids)
		if got := IDsFromContainer(seen(w)); !slices.Equal(got, tc.ids) {
			t.Errorf("%s %+v: decoded %v from %+v", tc.vendor, tc.host, got, w)
		}
	}
	w := Wire(api.GPUVendorNVIDIA, []string{"GPU-a"}, false)
	if !HasDisplay(w.Request) || HasDisplay(WithoutDisplay(w.Request)) || !HasDisplay(w.Request) {
		t.Fatal("WithoutDisplay must drop display without touching the original")
	}
	if w := Wire(api.GPUVendorAMD, []string{"/dev/dri/renderD128"}, false); !w.IpcHost || w.Devices[0] != (Device{"/dev/kfd", "/dev/kfd"}) {
		t.Fatalf("amd: %+v", w)
	}
}

// Gaudi and Tenstorrent are wired as dstack's shim wires them.
func TestWiringAsDstack(t *testing.T) {
	w := Wire(api.GPUVendorIntel, []string{"0", "1"}, false)
	if w.Runtime != "habana" || !slices.Equal(w.Env, []string{"HABANA_VISIBLE_DEVICES=0,1"}) || !w.IpcHost ||
		!slices.Equal(w.CapAdd, []string{"SYS_NICE"}) || w.Devices != nil || w.Request != nil {
		t.Fatalf("gaudi: %+v", w)
	}
	root := t.TempDir()
	w = Host{Root: root}.Wire(api.GPUVendorTenstorrent, []string{"0", "3"})
	want := []Device{{filepath.Join(root, "dev/tenstorrent/0"), "/dev/tenstorrent/0"}, {filepath.Join(root, "dev/tenstorrent/3"), "/dev/tenstorrent/3"}}
	if !slices.Equal(w.Devices, want) || w.Binds != nil || w.IpcHost || w.Runtime != "" {
		t.Fatalf("tenstorrent without hugepages: %+v", w)
	}
	if err := os.MkdirAll(filepath.Join(root, "dev/hugepages-1G"), 0o755); err != nil {
		t.Fatal(err)
	}
	w = Host{Root: root}.Wire(api.GPUVendorTenstorrent, []string{"0"})
	if !slices.Equal(w.Binds, []Bind{{filepath.Join(root, "dev/hugepages-1G"), "/dev/hugepages-1G"}}) {
		t.Fatalf("tenstorrent with hugepages: %+v", w)
	}
}

// What a container says of itself is decoded strictly: an image's own
// HABANA_VISIBLE_DEVICES, a device node that is not a card, or an id that
// is not a number never makes a container hold a card.
func TestIDsFromContainerRefuses(t *testing.T) {
	for name, c := range map[string]Seen{
		"image env, runc":          {Env: []string{"HABANA_VISIBLE_DEVICES=0,1"}},
		"image all":                {Env: []string{"HABANA_VISIBLE_DEVICES=all"}, Runtime: "habana"},
		"not numbers":              {Env: []string{"HABANA_VISIBLE_DEVICES=0x1,-1,01, 2,1024"}, Runtime: "habana"},
		"tt path differs":          {Devices: []Device{{"/dev/null", "/dev/tenstorrent/0"}}},
		"tt other card on host":    {Devices: []Device{{"/dev/tenstorrent/1", "/dev/tenstorrent/0"}}},
		"tt not a number":          {Devices: []Device{{"/dev/tenstorrent/../sda", "/dev/tenstorrent/../sda"}}},
		"tt device in a subdir":    {Devices: []Device{{"/dev/tenstorrent/0/x", "/dev/tenstorrent/0/x"}}},
		"user's own device mapped": {Devices: []Device{{"/dev/fuse", "/dev/fuse"}}},
	} {
		if got := IDsFromContainer(c); len(got) != 0 {
			t.Errorf("%s: decoded %v", name, got)
		}
	}
	// The shim's value, appended after the image's, is the one decoded.
	got := IDsFromContainer(Seen{Env: []string{"HABANA_VISIBLE_DEVICES=all", "HABANA_VISIBLE_DEVICES=2,5"}, Runtime: "habana"})
	if !slices.Equal(got, []string{"2", "5"}) {
		t.Errorf("the shim's value after an image's: %v", got)
	}
}
