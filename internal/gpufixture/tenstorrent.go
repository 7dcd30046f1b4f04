package gpufixture

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// TenstorrentChip adds one Tenstorrent PCI chip as tt-kmd shows it:
// /sys/class/tenstorrent/tenstorrent!<n> with tt_card_type (as the driver
// names the board: "n150", "n300", "p150a", "galaxy-wormhole", ...), its
// device link to the PCI device (vendor 0x1e52, NUMA node). An n300's
// second chip is reached over Ethernet and is not on the bus: add one chip
// for an n300.
func TenstorrentChip(t testing.TB, root string, n int, bus, cardType string, numa int) {
	t.Helper()
	device := "0x401e" // Wormhole
	if cardType[0] == 'p' || cardType == "galaxy-blackhole" {
		device = "0xb140" // Blackhole
	}
	pci := pciDevice(t, root, bus, map[string]string{"vendor": "0x1e52\n", "device": device + "\n", "numa_node": fmt.Sprintf("%d\n", numa)})
	node := classLink(t, root, "tenstorrent", fmt.Sprintf("tenstorrent!%d", n), pci)
	for file, data := range map[string]string{"tt_card_type": cardType + "\n", "tt_serial": fmt.Sprintf("%016x\n", 0x100014511000000+n)} {
		if err := os.WriteFile(filepath.Join(node, file), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// TenstorrentDriver writes the tenstorrent module's version.
func TenstorrentDriver(t testing.TB, root, version string) {
	moduleVersion(t, root, "tenstorrent", version)
}

// TenstorrentHost is a host of count chips of one card type, numbered
// from 0, half a NUMA node each (one node when count is 1), driver 2.0.0.
func TenstorrentHost(t testing.TB, root, cardType string, count int) {
	t.Helper()
	TenstorrentDriver(t, root, "2.0.0")
	for i := 0; i < count; i++ {
		numa := 0
		if count > 1 {
			numa = i * 2 / count
		}
		TenstorrentChip(t, root, i, fmt.Sprintf("0000:%02x:00.0", 0x01+i), cardType, numa)
	}
}
