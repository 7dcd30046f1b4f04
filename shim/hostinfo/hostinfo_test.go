package hostinfo

import (
	"encoding/json"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/shim/gpu"
)

func TestCollectAndWriteOnce(t *testing.T) {
	dir := t.TempDir()
	info, err := Collect([]gpu.GPU{{Vendor: api.GPUVendorNVIDIA, Name: "A100", MemoryMiB: 81920}, {Vendor: api.GPUVendorNVIDIA}}, dir)
	if err != nil {
		t.Fatal(err)
	}
	if info.CPUs != runtime.NumCPU() || info.Memory == 0 || info.DiskSize == 0 || info.GPUCount != 2 || info.GPUName != "A100" || info.GPUMemory != 81920 {
		t.Fatalf("facts: %+v", info)
	}
	path := filepath.Join(dir, "host_info.json")
	if wrote, err := WriteOnce(path, info); err != nil || !wrote {
		t.Fatalf("first write: %v %v", wrote, err)
	}
	var back api.HostInfo
	b, _ := os.ReadFile(path)
	if err := json.Unmarshal(b, &back); err != nil || back.CPUs != info.CPUs {
		t.Fatalf("read back: %s %v", b, err)
	}
	if wrote, err := WriteOnce(path, api.HostInfo{CPUs: 1}); err != nil || wrote {
		t.Fatalf("an existing file is left alone: %v %v", wrote, err)
	}
	none, _ := Collect(nil, dir)
	if none.GPUVendor != api.GPUVendorNone || none.GPUCount != 0 {
		t.Fatalf("no GPUs: %+v", none)
	}
}

// A part that cannot be read is left zero and said; the rest is the
// host's (it was all or nothing: no host_info.json at all).
func TestCollectIsPartialNotAllOrNothing(t *testing.T) {
	info, err := Collect([]gpu.GPU{{Vendor: api.GPUVendorAMD, Name: "MI300X"}}, filepath.Join(t.TempDir(), "gone"))
	if err == nil || !strings.Contains(err.Error(), "statfs") {
		t.Fatalf("the unreadable disk is not said: %v", err)
	}
	if info.DiskSize != 0 || info.Memory == 0 || info.CPUs != runtime.NumCPU() || info.GPUName != "MI300X" || info.Addresses == nil {
		t.Fatalf("what could be read was lost: %+v", info)
	}
}
