package gpufixture

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// pciDevice makes a PCI device dir with files and returns its path.
func pciDevice(t testing.TB, root, bus string, files map[string]string) string {
	t.Helper()
	pci := filepath.Join(root, "sys", "devices", "pci0000:00", bus)
	if err := os.MkdirAll(pci, 0o755); err != nil {
		t.Fatal(err)
	}
	for file, data := range files {
		if err := os.WriteFile(filepath.Join(pci, file), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return pci
}

// classLink adds /sys/class/<class>/<name>/device → pci.
func classLink(t testing.TB, root, class, name, pci string) string {
	t.Helper()
	node := filepath.Join(root, "sys", "class", class, name)
	if err := os.MkdirAll(node, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(pci, filepath.Join(node, "device")); err != nil {
		t.Fatal(err)
	}
	return node
}

// moduleVersion writes /sys/module/<module>/version.
func moduleVersion(t testing.TB, root, module, version string) {
	t.Helper()
	dir := filepath.Join(root, "sys", "module", module)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "version"), []byte(version+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
}

// GaudiCard adds one Habana card as the habanalabs driver shows it on a
// kernel with the accel class (6.4 on): /sys/class/accel/accel<minor>,
// the driver's attributes on the PCI device (device_type such as "GAUDI2",
// pci_addr, status), its NUMA node, and the accel_controlD node beside it.
func GaudiCard(t testing.TB, root string, minor int, bus, devType string, numa int) {
	t.Helper()
	pci := pciDevice(t, root, bus, map[string]string{
		"vendor": "0x1da3\n", "device": "0x1020\n", "device_type": devType + "\n", "pci_addr": bus + "\n",
		"status": "operational\n", "numa_node": fmt.Sprintf("%d\n", numa),
	})
	classLink(t, root, "accel", fmt.Sprintf("accel%d", minor), pci)
	classLink(t, root, "accel", fmt.Sprintf("accel_controlD%d", 64+minor), pci)
}

// LegacyGaudiCard adds one Habana card as kernels before 6.4 show it:
// /sys/class/habanalabs/hl<minor> holding the driver's attributes.
func LegacyGaudiCard(t testing.TB, root string, minor int, bus, devType string, numa int) {
	t.Helper()
	pci := pciDevice(t, root, bus, map[string]string{"vendor": "0x1da3\n", "numa_node": fmt.Sprintf("%d\n", numa)})
	node := classLink(t, root, "habanalabs", fmt.Sprintf("hl%d", minor), pci)
	for file, data := range map[string]string{"device_type": devType + "\n", "pci_addr": bus + "\n"} {
		if err := os.WriteFile(filepath.Join(node, file), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// OtherNPU adds a non-Habana compute accelerator under the accel class
// (an Intel Core Ultra NPU: vendor 0x8086, the intel_vpu driver).
func OtherNPU(t testing.TB, root string, minor int, bus string) {
	t.Helper()
	pci := pciDevice(t, root, bus, map[string]string{"vendor": "0x8086\n", "device": "0x7d1d\n", "numa_node": "-1\n"})
	classLink(t, root, "accel", fmt.Sprintf("accel%d", minor), pci)
	dev := filepath.Join(root, "dev", "accel")
	_ = os.MkdirAll(dev, 0o755)
	_ = os.WriteFile(filepath.Join(dev, fmt.Sprintf("accel%d", minor)), nil, 0o644)
}

// HabanaDriver writes the habanalabs module's version.
func HabanaDriver(t testing.TB, root, version string) { moduleVersion(t, root, "habanalabs", version) }

// Gaudi2Host is an 8-card Gaudi2 host (HL-225, 96 GiB each): four cards a
// NUMA node, driver 1.19.1.
func Gaudi2Host(t testing.TB, root string) {
	t.Helper()
	HabanaDriver(t, root, "1.19.1-6f47ddd")
	for i := 0; i < 8; i++ {
		GaudiCard(t, root, i, Gaudi2Bus(i), "GAUDI2", i/4)
	}
}

// Gaudi2Bus is the PCI address of card i of Gaudi2Host.
func Gaudi2Bus(i int) string { return fmt.Sprintf("0000:%02x:00.0", 0x19+i*0x10) }
