package gpu

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/tandem-run/tandem/api"
)

// habanaVendor is the PCI vendor id of Habana Labs (Intel Gaudi). The
// accel class is shared by every compute accelerator driver (Intel's and
// AMD's NPUs, Qualcomm's, ...): only this vendor makes a card ours.
const habanaVendor = "0x1da3"

// Gaudi discovers Intel Gaudi accelerators. The habanalabs driver's sysfs
// (Documentation/ABI/testing/sysfs-driver-habanalabs) says which cards
// there are, their type, PCI address and NUMA node; it has no memory size.
// hl-smi, where installed, gives the product name, the memory and its
// index (the id dstack's shim and the habana runtime use), joined to a
// sysfs card by PCI address; without it the driver's type names the card
// and the model's HBM size stands for its memory.
type Gaudi struct {
	Root string // "/" in production; a fixture tree in tests
	// HLSMI is the hl-smi to run ("hl-smi" on PATH when empty).
	HLSMI string
	// ToolTimeout bounds hl-smi's run (default 10 s: it answers in well
	// under a second on an 8-card host; a wedged driver makes it hang).
	ToolTimeout time.Duration
	Log         *slog.Logger // nil: nothing logged
}

// Vendor implements Source.
func (g Gaudi) Vendor() api.GPUVendor { return api.GPUVendorIntel }

func (g Gaudi) path(p ...string) string { return filepath.Join(append([]string{g.Root}, p...)...) }

// maxHLSMIOutput bounds what is read of hl-smi's answer: four short
// fields a card, 64 cards at most, is under 8 KiB.
const maxHLSMIOutput = 64 << 10

// gaudiNode names a card's node in the driver's classes: accel<n> (kernel
// 6.4 on, attributes on the PCI device) and hl<n> (the habanalabs class of
// older kernels, attributes on the class device itself).
var gaudiNode = regexp.MustCompile(`^(?:accel|hl)([0-9]{1,4})$`)

// gaudiCard is one card as sysfs shows it.
type gaudiCard struct {
	minor int
	GPU
	devType string
}

// Discover implements Source.
func (g Gaudi) Discover(ctx context.Context) ([]GPU, error) {
	cards := g.sysfsCards()
	if len(cards) == 0 {
		return nil, fmt.Errorf("%w: no Habana accelerator (PCI vendor %s) under /sys/class/accel or /sys/class/habanalabs", ErrNotPresent, habanaVendor)
	}
	rows, err := g.hlsmi(ctx)
	log := g.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if err != nil {
		log.Warn("hl-smi gave nothing: Gaudi names from the driver's type, memory from the model", "err", err)
	}
	byBus := map[string]hlsmiRow{}
	for _, r := range rows {
		byBus[r.bus] = r
	}
	out := make([]GPU, 0, len(cards))
	seenIdx := map[int]bool{}
	for _, c := range cards {
		gp := c.GPU
		if r, ok := byBus[c.PCIBusID]; ok && !seenIdx[r.index] {
			gp.Name, gp.MemoryMiB, gp.Index = r.name, r.memMiB, r.index
		} else {
			if ok {
				log.Warn("hl-smi gave one index to two cards: the driver's minor stands", "index", r.index, "pci", c.PCIBusID)
			}
			gp.Name, gp.MemoryMiB = gaudiModel(c.devType)
			gp.Index = c.minor
		}
		if seenIdx[gp.Index] {
			log.Warn("two Gaudi cards with one index: the second is left out", "index", gp.Index, "pci", gp.PCIBusID)
			continue
		}
		seenIdx[gp.Index] = true
		gp.ID = strconv.Itoa(gp.Index)
		out = append(out, gp)
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].Index < out[j].Index })
	return out, nil
}

// sysfsCards lists the Habana cards of both classes, once each (by PCI
// address), in minor order.
func (g Gaudi) sysfsCards() []gaudiCard {
	driver := moduleVersion(g.Root, "habanalabs")
	seen := map[string]bool{}
	var cards []gaudiCard
	for _, class := range []string{"accel", "habanalabs"} {
		entries, _ := os.ReadDir(g.path("sys", "class", class))
		for _, ent := range entries {
			m := gaudiNode.FindStringSubmatch(ent.Name())
			if m == nil {
				continue // accel_controlD<n> and anything else
			}
			node := g.path("sys", "class", class, ent.Name())
			pci := filepath.Join(node, "device")
			if readTrim(filepath.Join(pci, "vendor")) != habanaVendor {
				continue // another vendor's NPU: not a Gaudi host
			}
			attrs := pci // accel: the driver's attributes are the PCI device's
			if class == "habanalabs" {
				attrs = node
			}
			bus := pciAddress(readTrim(filepath.Join(attrs, "pci_addr")))
			if bus == "" {
				if target, err := os.Readlink(pci); err == nil {
					bus = pciAddress(filepath.Base(target))
				}
			}
			if bus == "" || seen[bus] {
				continue
			}
			seen[bus] = true
			minor, _ := strconv.Atoi(m[1])
			numa := -1
			if v, err := strconv.Atoi(readTrim(filepath.Join(pci, "numa_node"))); err == nil && v >= 0 && v < 1024 {
				numa = v
			}
			cards = append(cards, gaudiCard{minor: minor, devType: boundedWord(readTrim(filepath.Join(attrs, "device_type"))),
				GPU: GPU{Vendor: api.GPUVendorIntel, DriverVersion: driver, PCIBusID: bus, NUMANode: numa}})
		}
	}
	sort.SliceStable(cards, func(i, j int) bool { return cards[i].minor < cards[j].minor })
	return cards
}

// gaudiModel is the name and memory of a card from the driver's type when
// hl-smi cannot say: the market names the dstack server maps hl-smi's
// product names to (HL-225 is Gaudi2), and each model's HBM in MiB.
func gaudiModel(devType string) (string, int64) {
	t := strings.ToUpper(devType)
	switch {
	case strings.HasPrefix(t, "GAUDI3"):
		return "Gaudi3", 128 << 10
	case strings.HasPrefix(t, "GAUDI2"):
		return "Gaudi2", 96 << 10
	case strings.HasPrefix(t, "GAUDI"):
		return "Gaudi", 32 << 10
	case t == "":
		return "Gaudi", 0
	}
	return devType, 0
}

// hlsmiRow is one card of hl-smi's answer.
type hlsmiRow struct {
	name   string
	memMiB int64
	index  int
	bus    string
}

// hlsmiArgs are dstack's query with the PCI address added, by which a row
// is joined to its sysfs card (never by position).
var hlsmiArgs = []string{"--query-aip=name,memory.total,index,bus_id", "--format=csv,noheader,nounits"}

func (g Gaudi) hlsmi(ctx context.Context) ([]hlsmiRow, error) {
	tool := g.HLSMI
	if tool == "" {
		tool = "hl-smi"
	}
	timeout := g.ToolTimeout
	if timeout <= 0 {
		timeout = 10 * time.Second
	}
	out, err := runTool(ctx, timeout, maxHLSMIOutput, tool, hlsmiArgs...)
	if err != nil {
		return nil, err
	}
	return parseHLSMI(out)
}

// errHLSMI says hl-smi's answer is not what was asked for.
var errHLSMI = errors.New("hl-smi answer")

// parseHLSMI reads hl-smi's CSV: name, memory.total (MiB), index, bus_id
// a line. A line that does not fit fails the whole answer: a tool that
// answers something else is not trusted for any card.
func parseHLSMI(out []byte) ([]hlsmiRow, error) {
	var rows []hlsmiRow
	for n, line := range strings.Split(string(out), "\n") {
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		if len(rows) == 256 {
			return nil, fmt.Errorf("%w: more than 256 cards", errHLSMI)
		}
		f := strings.Split(line, ",")
		if len(f) != 4 {
			return nil, fmt.Errorf("%w: line %d has %d fields, want 4", errHLSMI, n+1, len(f))
		}
		for i := range f {
			f[i] = strings.TrimSpace(f[i])
		}
		name := boundedWord(f[0])
		if name == "" || name != f[0] {
			return nil, fmt.Errorf("%w: line %d: name %.40q", errHLSMI, n+1, f[0])
		}
		mem, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(f[1], "MiB")), 10, 64)
		if err != nil || mem < 0 || mem > 1<<24 { // 16 TiB
			return nil, fmt.Errorf("%w: line %d: memory %.40q", errHLSMI, n+1, f[1])
		}
		idx, err := strconv.Atoi(f[2])
		if err != nil || idx < 0 || idx > 1023 {
			return nil, fmt.Errorf("%w: line %d: index %.40q", errHLSMI, n+1, f[2])
		}
		bus := pciAddress(f[3])
		if bus == "" {
			return nil, fmt.Errorf("%w: line %d: bus id %.40q", errHLSMI, n+1, f[3])
		}
		rows = append(rows, hlsmiRow{name: name, memMiB: mem, index: idx, bus: bus})
	}
	return rows, nil
}

var pciAddr = regexp.MustCompile(`^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$`)

// pciAddress is a PCI address as sysfs names it (0000:19:00.0), from the
// forms the tools print (00000000:19:00.0 as nvidia-smi); "" when it is
// not one.
func pciAddress(s string) string {
	m := pciAddr.FindStringSubmatch(strings.TrimSpace(s))
	if m == nil {
		return ""
	}
	dom, err := strconv.ParseUint(m[1], 16, 32)
	if err != nil || dom > 0xffff {
		return ""
	}
	return strings.ToLower(fmt.Sprintf("%04x:%s:%s.%s", dom, m[2], m[3], m[4]))
}

// boundedWord is s if it is a short printable name (what a product name
// or a device type is), else "": a driver or tool's bytes reach the API
// and the server's database.
func boundedWord(s string) string {
	if len(s) == 0 || len(s) > 64 {
		return ""
	}
	for _, r := range s {
		if r < 0x20 || r > 0x7e {
			return ""
		}
	}
	return s
}
