package gpu

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/internal/gpufixture"
)

// fakeTool writes an executable script standing for a vendor tool.
func fakeTool(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "hl-smi")
	if err := os.WriteFile(p, []byte("#!/bin/sh\n"+body+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

// hlsmiAnswer is what hl-smi prints for the query on Gaudi2Host, its
// indices in reverse of the driver's minors (hl-smi's order is its own):
// the join is by PCI address.
func hlsmiAnswer() string {
	var b strings.Builder
	for i := 7; i >= 0; i-- {
		fmt.Fprintf(&b, "HL-225, 98304, %d, %s\n", 7-i, strings.Replace(gpufixture.Gaudi2Bus(i), "0000:", "00000000:", 1))
	}
	return b.String()
}

func TestGaudi2Host(t *testing.T) {
	root := t.TempDir()
	gpufixture.Gaudi2Host(t, root)
	tool := fakeTool(t, "[ \"$1 $2\" = '--query-aip=name,memory.total,index,bus_id --format=csv,noheader,nounits' ] || exit 3\ncat <<'X'\n"+hlsmiAnswer()+"X")
	for _, tc := range []struct {
		name, tool, wantName string
		index                func(minor int) int
	}{
		{"with hl-smi", tool, "HL-225", func(m int) int { return 7 - m }},
		{"without hl-smi", filepath.Join(t.TempDir(), "absent"), "Gaudi2", func(m int) int { return m }},
		{"hl-smi answering garbage", fakeTool(t, "echo 'HL-225, lots, 0, 0000:19:00.0'"), "Gaudi2", func(m int) int { return m }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gpus, err := Discover(context.Background(), logging.Discard(), Gaudi{Root: root, HLSMI: tc.tool})
			if err != nil || len(gpus) != 8 {
				t.Fatalf("%v %v", gpus, err)
			}
			for _, g := range gpus {
				minor := -1
				for m := 0; m < 8; m++ {
					if gpufixture.Gaudi2Bus(m) == g.PCIBusID {
						minor = m
					}
				}
				idx := tc.index(minor)
				if minor < 0 || g.Vendor != api.GPUVendorIntel || g.Name != tc.wantName || g.MemoryMiB != 98304 || g.Index != idx ||
					g.ID != fmt.Sprint(idx) || g.NUMANode != minor/4 || g.DriverVersion != "1.19.1-6f47ddd" {
					t.Errorf("card %+v (minor %d)", g, minor)
				}
			}
			if gpus[0].Index != 0 || gpus[7].Index != 7 {
				t.Errorf("not in index order: %+v", gpus)
			}
		})
	}
}

// Kernels before 6.4 put the driver under /sys/class/habanalabs.
func TestGaudiLegacyClass(t *testing.T) {
	root := t.TempDir()
	gpufixture.LegacyGaudiCard(t, root, 0, "0000:33:00.0", "GAUDI", 0)
	gpufixture.LegacyGaudiCard(t, root, 1, "0000:34:00.0", "GAUDI", 1)
	gpus, err := Gaudi{Root: root, HLSMI: "/nonexistent"}.Discover(context.Background())
	if err != nil || len(gpus) != 2 || gpus[1].Name != "Gaudi" || gpus[1].MemoryMiB != 32768 || gpus[1].ID != "1" || gpus[1].NUMANode != 1 || gpus[1].PCIBusID != "0000:34:00.0" {
		t.Fatalf("%+v %v", gpus, err)
	}
}

// A tool that hangs or floods is cut off, and the cards stand from sysfs.
func TestGaudiToolBounds(t *testing.T) {
	root := t.TempDir()
	gpufixture.GaudiCard(t, root, 0, "0000:19:00.0", "GAUDI3", 0)
	for name, body := range map[string]string{
		"hangs":  "exec sleep 600",
		"floods": "exec yes 'HL-325L, 131072, 0, 0000:19:00.0'",
		"fails":  "echo 'hl-smi: cannot open device' >&2; exit 1",
	} {
		t.Run(name, func(t *testing.T) {
			g := Gaudi{Root: root, HLSMI: fakeTool(t, body), ToolTimeout: 2 * time.Second}
			if _, err := g.hlsmi(context.Background()); err == nil {
				t.Fatal("the tool's answer was taken")
			}
			gpus, err := g.Discover(context.Background())
			if err != nil || len(gpus) != 1 || gpus[0].Name != "Gaudi3" || gpus[0].MemoryMiB != 128<<10 {
				t.Fatalf("%+v %v", gpus, err)
			}
		})
	}
}

func TestParseHLSMI(t *testing.T) {
	good := "HL-225, 98304, 0, 0000:19:00.0\nHL-225B, 98304 MiB, 1, 00000000:1A:00.0\n"
	rows, err := parseHLSMI([]byte(good))
	if err != nil || len(rows) != 2 || rows[1] != (hlsmiRow{name: "HL-225B", memMiB: 98304, index: 1, bus: "0000:1a:00.0"}) {
		t.Fatalf("%+v %v", rows, err)
	}
	for _, bad := range []string{
		"HL-225, 98304, 0",                    // a field short
		"HL-225, 98304, 0, 0000:19:00.0, x",   // one too many
		"HL-225, -1, 0, 0000:19:00.0",         // negative memory
		"HL-225, 98304, 1024, 0000:19:00.0",   // index out of range
		"HL-225, 98304, 0, /dev/accel/accel0", // not a PCI address
		"HL\x1b[31m, 98304, 0, 0000:19:00.0",  // escape bytes in a name
		strings.Repeat("HL-225, 1, 0, 0000:19:00.0\n", 257),
	} {
		if rows, err := parseHLSMI([]byte(bad)); err == nil {
			t.Errorf("%.60q taken: %+v", bad, rows)
		}
	}
}

// FuzzParseHLSMI: whatever hl-smi prints, the rows are bounded: at most
// 256, names short and printable, indices and memory in range, addresses
// in sysfs's form.
func FuzzParseHLSMI(f *testing.F) {
	f.Add([]byte(hlsmiAnswer()))
	f.Add([]byte("HL-225, 98304 MiB, 0, 00000000:1A:00.0\n\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		rows, err := parseHLSMI(b)
		if err != nil {
			return
		}
		if len(rows) > 256 {
			t.Fatalf("%d rows", len(rows))
		}
		for _, r := range rows {
			if boundedWord(r.name) != r.name || r.name == "" || r.index < 0 || r.index > 1023 || r.memMiB < 0 || r.memMiB > 1<<24 || pciAddress(r.bus) != r.bus {
				t.Fatalf("row %+v", r)
			}
		}
	})
}
