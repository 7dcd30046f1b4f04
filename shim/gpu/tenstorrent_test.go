package gpu

import (
	"context"
	"fmt"
	"testing"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/internal/gpufixture"
)

func TestTenstorrentBoards(t *testing.T) {
	for _, tc := range []struct {
		cardType string
		chips    int // PCI chips on the host
		name     string
		mem      int64
	}{
		{"n150", 1, "n150", 12 << 10},
		{"n300", 1, "n300", 24 << 10}, // two chips, one card: the remote chip is not on the bus
		{"n300", 4, "n300", 24 << 10}, // a TT-LoudBox: four n300s
		{"p150a", 1, "p150", 32 << 10},
		{"p150b", 4, "p150", 32 << 10},
		{"galaxy-wormhole", 32, "tt-galaxy-wh", 12 << 10},
		{"galaxy-blackhole", 32, "tt-galaxy-bh", 32 << 10},
		{"p300a", 2, "p300", 32 << 10},
		{"p100", 1, "p100a", 28 << 10},
	} {
		t.Run(fmt.Sprintf("%s×%d", tc.cardType, tc.chips), func(t *testing.T) {
			root := t.TempDir()
			gpufixture.TenstorrentHost(t, root, tc.cardType, tc.chips)
			gpus, err := Tenstorrent{Root: root}.Discover(context.Background())
			if err != nil || len(gpus) != tc.chips {
				t.Fatalf("%+v %v", gpus, err)
			}
			for i, g := range gpus {
				numa := 0
				if tc.chips > 1 {
					numa = i * 2 / tc.chips
				}
				if g.Vendor != api.GPUVendorTenstorrent || g.Name != tc.name || g.MemoryMiB != tc.mem || g.ID != fmt.Sprint(i) || g.Index != i ||
					g.DriverVersion != "2.0.0" || g.PCIBusID != fmt.Sprintf("0000:%02x:00.0", 1+i) || g.NUMANode != numa {
					t.Errorf("chip %d: %+v", i, g)
				}
			}
		})
	}
}

func TestTenstorrentNotPresent(t *testing.T) {
	root := t.TempDir()
	if _, err := (Tenstorrent{Root: root}).Discover(context.Background()); err == nil {
		t.Fatal("no class, yet cards")
	}
}
