package cli

import (
	"bytes"
	"strings"
	"testing"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/ctl"
)

func TestBytesText(t *testing.T) {
	for n, want := range map[uint64]string{0: "0B", 1023: "1023B", 1 << 10: "1KiB", 3 << 29: "1.5GiB", 300 << 20: "300MiB", 5 << 40: "5TiB"} {
		if got := ctl.BytesText(n); got != want {
			t.Errorf("ctl.BytesText(%d) = %q, want %q", n, got, want)
		}
	}
}

// TestStatsTable: each GPU's use in one column, their memory summed; a
// row without figures is dashes; names from the shim are escaped.
func TestStatsTable(t *testing.T) {
	pct := 187.5
	var b bytes.Buffer
	err := statsTable(&b, []ctl.Stat{
		{Name: "train", ID: "0123456789abcdef", CPUPercent: &pct, MemoryBytes: 3 << 30, MemoryLimit: 12 << 30,
			GPUs: []api.GPUMetrics{{GPUUtilPercent: 87, GPUMemoryUsageBytes: 10 << 30}, {GPUUtilPercent: 90, GPUMemoryUsageBytes: 6 << 30}}},
		{Name: "evil\x1b[2J", ID: "fedcba9876543210", Error: "runner at 127.0.0.1:1: refused"},
		{ID: "aaaaaaaabbbb", MemoryBytes: 1 << 20},
	})
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	want := [][]string{
		{"NAME", "ID", "CPU", "%", "MEM", "USAGE", "/", "LIMIT", "MEM", "%", "GPU", "UTIL", "GPU", "MEM"},
		{"train", "01234567", "187.5%", "3GiB", "/", "12GiB", "25.0%", "87%,90%", "16GiB"},
		{"evil\\x1b[2J", "fedcba98", "-", "-", "-", "-", "-"},
		{"-", "aaaaaaaa", "-", "1MiB", "/", "-", "-", "-", "-"},
	}
	if len(lines) != len(want) {
		t.Fatalf("table:\n%s", b.String())
	}
	for i, l := range lines {
		if got := strings.Fields(l); strings.Join(got, " ") != strings.Join(want[i], " ") {
			t.Errorf("line %d: %q, want %q", i, got, want[i])
		}
	}
}
