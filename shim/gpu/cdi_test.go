package gpu

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/tandem-run/tandem/api"
)

// An excerpt of what `nvidia-ctk cdi generate` writes (index and uuid
// names, and "all").
const nvidiaCTKSpec = `---
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
- name: "0"
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
- name: GPU-11111111-2222-3333-4444-555555555555
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
- name: all
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
containerEdits:
  env:
  - NVIDIA_VISIBLE_DEVICES=void
`

// TestCDIGPUNames: the NVIDIA GPU names of every spec (YAML or JSON) in
// the dirs, once each; specs of other kinds, other files and a missing dir
// add nothing; a spec that is garbage, too big or no regular file (a FIFO
// would block the start) is reported and skipped.
func TestCDIGPUNames(t *testing.T) {
	a, b := t.TempDir(), t.TempDir()
	write := func(path, data string) {
		t.Helper()
		if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(filepath.Join(a, "nvidia.yaml"), nvidiaCTKSpec)
	write(filepath.Join(b, "extra.json"), `{"cdiVersion":"0.5.0","kind":"nvidia.com/gpu","devices":[{"name":"GPU-aaaaaaaa-0000-0000-0000-000000000000"},{"name":"all"}]}`)
	write(filepath.Join(b, "nic.yaml"), "cdiVersion: 0.5.0\nkind: vendor.example/nic\ndevices:\n- name: GPU-not-a-gpu\n")
	write(filepath.Join(b, "notes.txt"), "kind: nvidia.com/gpu\ndevices:\n- name: GPU-txt\n")
	write(filepath.Join(b, "broken.yml"), "kind: [nvidia.com/gpu\n")
	write(filepath.Join(b, "huge.json"), `{"kind":"nvidia.com/gpu","devices":[{"name":"GPU-huge"}],"pad":"`+strings.Repeat("x", maxCDISpec)+`"}`)
	if err := os.Mkdir(filepath.Join(b, "sub.yaml"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(filepath.Join(b, "fifo.yaml"), 0o644); err != nil {
		t.Fatal(err)
	}

	names, problems := CDIGPUNames([]string{a, filepath.Join(a, "missing"), b, a})
	want := []string{"0", "GPU-11111111-2222-3333-4444-555555555555", "all", "GPU-aaaaaaaa-0000-0000-0000-000000000000"}
	if !slices.Equal(names, want) {
		t.Errorf("names %q, want %q", names, want)
	}
	if len(problems) != 3 || !strings.Contains(problems[0].Error(), "broken.yml") || !strings.Contains(problems[1].Error(), "fifo.yaml: not a regular file") ||
		!strings.Contains(problems[2].Error(), "huge.json: larger than") {
		t.Errorf("problems %v, want broken.yml, fifo.yaml and huge.json", problems)
	}
}

// TestCDIMissing: NVIDIA GPUs no name resolves, by UUID; AMD GPUs are not
// CDI's concern here, and an index name does not stand for a UUID (the
// shim asks by UUID).
func TestCDIMissing(t *testing.T) {
	gpus := []GPU{
		{Vendor: api.GPUVendorNVIDIA, ID: "GPU-11111111-2222-3333-4444-555555555555", Index: 0},
		{Vendor: api.GPUVendorNVIDIA, ID: "GPU-66666666-7777-8888-9999-000000000000", Index: 1},
		{Vendor: api.GPUVendorAMD, ID: "/dev/dri/renderD128"},
	}
	got := CDIMissing(gpus, []string{"0", "1", "all", "GPU-11111111-2222-3333-4444-555555555555"})
	if !slices.Equal(got, []string{"GPU-66666666-7777-8888-9999-000000000000"}) {
		t.Errorf("missing %q", got)
	}
	if got := CDIMissing(gpus, nil); len(got) != 2 {
		t.Errorf("no spec: missing %q, want both NVIDIA GPUs", got)
	}
}
