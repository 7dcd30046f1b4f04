package gpu

import (
	"os"
	"path/filepath"
	"testing"
)

// TestNVMLLibraryOnWSL: a WSL2 guest (/dev/dxg and WSL's libnvidia-ml)
// loads WSL's library; /dev/dxg alone, or the library alone, is no WSL
// NVIDIA host.
func TestNVMLLibraryOnWSL(t *testing.T) {
	mk := func(t *testing.T, files ...string) string {
		root := t.TempDir()
		for _, f := range files {
			p := filepath.Join(root, f)
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, nil, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		return root
	}
	for _, c := range []struct {
		name  string
		files []string
		want  string
	}{
		{"WSL2 with the driver's libraries", []string{"dev/dxg", wslNVML}, wslNVML},
		{"dxg without the library", []string{"dev/dxg"}, ""},
		{"the library without dxg", []string{wslNVML}, ""},
		{"a plain host", nil, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := nvmlLibrary(mk(t, c.files...)); got != c.want {
				t.Fatalf("nvmlLibrary = %q, want %q", got, c.want)
			}
		})
	}
}
