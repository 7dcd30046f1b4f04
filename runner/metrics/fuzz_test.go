package metrics

import (
	"bytes"
	"encoding/csv"
	"strings"
	"testing"

	"github.com/tandem-run/tandem/api"
)

// Each vendor tool's reader is fed what a job's image could print: it must
// not panic, and what it accepts is sane (a percent 0-100, whole MiB that
// fit in bytes, at most maxGPUs GPUs).

func saneGPUs(t *testing.T, in []byte, g []api.GPUMetrics, wholeMiB bool) {
	t.Helper()
	if len(g) > maxGPUs {
		t.Fatalf("%q: %d GPUs, above %d", in, len(g), maxGPUs)
	}
	for _, m := range g {
		if m.GPUUtilPercent < 0 || m.GPUUtilPercent > 100 {
			t.Fatalf("%q: utilisation %d", in, m.GPUUtilPercent)
		}
		if wholeMiB && (m.GPUMemoryUsageBytes%(1<<20) != 0 || m.GPUMemoryUsageBytes>>20 > maxMiB) {
			t.Fatalf("%q: memory %d is not a MiB count read back", in, m.GPUMemoryUsageBytes)
		}
	}
}

func FuzzParseAMDSMI(f *testing.F) {
	f.Add([]byte(amdSMITwo))
	f.Add([]byte(amdSMINA))
	f.Add([]byte("gpu,gfx,vram_used\n0,100,0\n"))
	f.Add([]byte("\"gfx\",vram_used,vram_total\n\"5\",3,2\n"))
	f.Fuzz(func(t *testing.T, in []byte) {
		g, err := parseAMDSMI(in)
		if err != nil {
			if g != nil {
				t.Fatalf("%q: an error with GPUs %+v", in, g)
			}
			return
		}
		if len(g) == 0 {
			t.Fatalf("%q: accepted with no GPU", in)
		}
		saneGPUs(t, in, g, true)
		// Where the header names vram_total, no accepted GPU uses more:
		// read the totals back on their own.
		r := csv.NewReader(bytes.NewReader(in))
		r.TrimLeadingSpace = true
		rows, err := r.ReadAll()
		if err != nil || len(rows) != len(g)+1 {
			t.Fatalf("%q: accepted, but it reads as %d rows (%v) for %d GPUs", in, len(rows), err, len(g))
		}
		for j, h := range rows[0] {
			if strings.TrimSpace(h) != "vram_total" {
				continue
			}
			for i, m := range g {
				total, err := parseDec(rows[i+1][j])
				if err != nil || m.GPUMemoryUsageBytes>>20 > total {
					t.Fatalf("%q GPU %d: used %d MiB, total %q", in, i, m.GPUMemoryUsageBytes>>20, rows[i+1][j])
				}
			}
		}
	})
}

func FuzzParseHLSMI(f *testing.F) {
	f.Add([]byte(hlSMITwo))
	f.Add([]byte("1, 2, 3\n"))
	f.Add([]byte("2, 1, 3 %\n"))
	f.Fuzz(func(t *testing.T, in []byte) {
		g, err := parseHLSMI(in)
		if err != nil {
			return
		}
		saneGPUs(t, in, g, true)
		// Every accepted line said used <= total: read the totals back.
		for i, l := range strings.Split(strings.TrimSpace(string(in)), "\n") {
			total, err := parseDec(strings.Split(l, ",")[1])
			if err != nil || g[i].GPUMemoryUsageBytes>>20 > total {
				t.Fatalf("%q line %d: used %d MiB, total %d (%v)", in, i, g[i].GPUMemoryUsageBytes>>20, total, err)
			}
		}
	})
}

func FuzzParseNvidiaSMI(f *testing.F) {
	f.Add([]byte("1024, 87\n0, 0\n"))
	f.Add([]byte("[N/A], [N/A]\n"))
	f.Fuzz(func(t *testing.T, in []byte) {
		g, err := parseNvidiaSMI(in)
		if err != nil {
			return
		}
		saneGPUs(t, in, g, true)
	})
}

func FuzzAMDFromSysfs(f *testing.F) {
	f.Add("3221225472\n", "206158430208\n", "87\n")
	f.Add("5", "4", "101")
	f.Add("", "1", "-1")
	f.Fuzz(func(t *testing.T, used, total, busy string) {
		g, err := amdFromSysfs(used, total, busy)
		if err != nil {
			return
		}
		saneGPUs(t, []byte(used+"|"+total+"|"+busy), []api.GPUMetrics{g}, false)
		tot, err := parseDec(total)
		if err != nil || g.GPUMemoryUsageBytes > tot {
			t.Fatalf("used %d above total %q", g.GPUMemoryUsageBytes, total)
		}
	})
}
