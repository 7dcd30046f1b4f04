package agent

import (
	"bytes"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/shim/gpu"
)

// TestCheckCDISpecs: with Docker taking GPUs as CDI devices, a GPU that no
// spec names is warned about at start, with the fix; once a spec names
// every GPU, the log says so and warns of nothing.
func TestCheckCDISpecs(t *testing.T) {
	dir := t.TempDir()
	gpus := []gpu.GPU{
		{Vendor: api.GPUVendorNVIDIA, ID: "GPU-11111111-2222-3333-4444-555555555555"},
		{Vendor: api.GPUVendorNVIDIA, ID: "GPU-66666666-7777-8888-9999-000000000000"},
	}
	check := func() ([]string, string) {
		var buf bytes.Buffer
		missing := checkCDISpecs(slog.New(slog.NewTextHandler(&buf, nil)), []string{dir, "/nonexistent/cdi"}, gpus)
		return missing, buf.String()
	}

	missing, log := check()
	if !slices.Equal(missing, []string{gpus[0].ID, gpus[1].ID}) || !strings.Contains(log, "level=WARN") || !strings.Contains(log, "nvidia-ctk cdi generate") {
		t.Errorf("no spec: missing %q, log:\n%s", missing, log)
	}

	spec := "kind: nvidia.com/gpu\ndevices:\n- name: \"0\"\n- name: " + gpus[0].ID + "\n"
	if err := os.WriteFile(filepath.Join(dir, "nvidia.yaml"), []byte(spec), 0o644); err != nil {
		t.Fatal(err)
	}
	if missing, log = check(); !slices.Equal(missing, []string{gpus[1].ID}) || !strings.Contains(log, gpus[1].ID) || strings.Contains(log, "gpus=\"["+gpus[0].ID) {
		t.Errorf("one GPU named: missing %q, log:\n%s", missing, log)
	}

	spec += "- name: " + gpus[1].ID + "\n"
	if err := os.WriteFile(filepath.Join(dir, "nvidia.yaml"), []byte(spec), 0o644); err != nil {
		t.Fatal(err)
	}
	if missing, log = check(); missing != nil || strings.Contains(log, "level=WARN") || !strings.Contains(log, "CDI specs name every GPU") {
		t.Errorf("every GPU named: missing %q, log:\n%s", missing, log)
	}
}
