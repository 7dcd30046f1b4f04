package gpu

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"github.com/tandem-run/tandem/api"
)

// tenstorrentVendor is Tenstorrent's PCI vendor id.
const tenstorrentVendor = "0x1e52"

// Tenstorrent discovers Tenstorrent cards from the tt-kmd driver's sysfs:
// /sys/class/tenstorrent/tenstorrent!<N> is the chip that is
// /dev/tenstorrent/<N>, its tt_card_type the board (the driver reads it
// from the chip's firmware telemetry). Only chips on the PCI bus are
// there: the second chip of an n300 hangs off the first over Ethernet and
// is no device of its own, so an n300 is one card of both chips' memory,
// as dstack counts it. dstack runs tt-smi from an image it pulls; sysfs
// says the same without any image.
type Tenstorrent struct {
	Root string // "/" in production; a fixture tree in tests
}

// Vendor implements Source.
func (t Tenstorrent) Vendor() api.GPUVendor { return api.GPUVendorTenstorrent }

var ttNode = regexp.MustCompile(`^tenstorrent!([0-9]{1,4})$`)

// Discover implements Source.
func (t Tenstorrent) Discover(context.Context) ([]GPU, error) {
	class := filepath.Join(t.Root, "sys", "class", "tenstorrent")
	entries, err := os.ReadDir(class)
	if err != nil {
		return nil, fmt.Errorf("%w: no /sys/class/tenstorrent (tt-kmd not loaded)", ErrNotPresent)
	}
	driver := moduleVersion(t.Root, "tenstorrent")
	var out []GPU
	for _, ent := range entries {
		m := ttNode.FindStringSubmatch(ent.Name())
		if m == nil {
			continue
		}
		node := filepath.Join(class, ent.Name())
		pci := filepath.Join(node, "device")
		if readTrim(filepath.Join(pci, "vendor")) != tenstorrentVendor {
			continue
		}
		n, _ := strconv.Atoi(m[1])
		name, mem := ttBoard(readTrim(filepath.Join(node, "tt_card_type")))
		bus := ""
		if target, err := os.Readlink(pci); err == nil {
			bus = pciAddress(filepath.Base(target))
		}
		numa := -1
		if v, err := strconv.Atoi(readTrim(filepath.Join(pci, "numa_node"))); err == nil && v >= 0 && v < 1024 {
			numa = v
		}
		out = append(out, GPU{Vendor: api.GPUVendorTenstorrent, Name: name, MemoryMiB: mem, ID: strconv.Itoa(n), Index: n,
			DriverVersion: driver, PCIBusID: bus, NUMANode: numa})
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: no Tenstorrent chip (PCI vendor %s) under /sys/class/tenstorrent", ErrNotPresent, tenstorrentVendor)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Index < out[j].Index })
	return out, nil
}

// ttBoard is a board's name as dstack's server knows it and the memory of
// one PCI chip of it in MiB (an n300's includes its remote chip's), from
// the driver's card type.
func ttBoard(cardType string) (string, int64) {
	switch t := strings.ToLower(boundedWord(cardType)); {
	case t == "n150":
		return "n150", 12 << 10
	case t == "n300":
		return "n300", 24 << 10
	case t == "galaxy-wormhole":
		return "tt-galaxy-wh", 12 << 10
	case t == "galaxy-blackhole":
		return "tt-galaxy-bh", 32 << 10
	case t == "p100" || t == "p100a":
		return "p100a", 28 << 10
	case strings.HasPrefix(t, "p150"):
		return "p150", 32 << 10
	case strings.HasPrefix(t, "p300"):
		return "p300", 32 << 10
	case t == "":
		return "tenstorrent", 0
	default:
		return t, 0
	}
}
