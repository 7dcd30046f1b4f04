// Package gpufixture builds fixture sysfs trees of GPUs for tests: the
// shim's discovery unit tests and the binary run against --host-root.
package gpufixture

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// AMDCard adds one AMD render node to the fixture tree at root.
func AMDCard(t testing.TB, root string, render int, bus string, vramMiB int64, name string, numa int) {
	t.Helper()
	pci := filepath.Join(root, "sys", "devices", "pci0000:00", bus)
	if err := os.MkdirAll(pci, 0o755); err != nil {
		t.Fatal(err)
	}
	for file, data := range map[string]string{
		"vendor": "0x1002\n", "device": "0x74a1\n", "mem_info_vram_total": fmt.Sprintf("%d\n", vramMiB<<20),
		"product_name": name + "\n", "numa_node": fmt.Sprintf("%d\n", numa),
	} {
		if err := os.WriteFile(filepath.Join(pci, file), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	node := filepath.Join(root, "sys", "class", "drm", fmt.Sprintf("renderD%d", render))
	_ = os.MkdirAll(node, 0o755)
	if err := os.Symlink(pci, filepath.Join(node, "device")); err != nil {
		t.Fatal(err)
	}
}

// KFD adds the AMD compute driver's nodes (and its version, when given).
func KFD(t testing.TB, root, driver string) {
	t.Helper()
	_ = os.MkdirAll(filepath.Join(root, "sys", "class", "kfd", "kfd"), 0o755)
	if driver != "" {
		_ = os.MkdirAll(filepath.Join(root, "sys", "module", "amdgpu"), 0o755)
		if err := os.WriteFile(filepath.Join(root, "sys", "module", "amdgpu", "version"), []byte(driver+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}
