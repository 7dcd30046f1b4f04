package portrange

import (
	"os"
	"path/filepath"
	"testing"
)

func TestReadPortRange(t *testing.T) {
	dir := t.TempDir()
	for body, want := range map[string]string{
		"32768\t60999\n": "32768-60999",
		"1024 65535":     "1024-65535",
		"":               "error",
		"1 2 3":          "error",
		"9 x":            "error",
		"60999 32768":    "error",
	} {
		p := filepath.Join(dir, "range")
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		r, err := Read(p)
		got := "error"
		if err == nil {
			got = r.String()
		}
		if got != want {
			t.Errorf("%q: got %s (%v), want %s", body, got, err, want)
		}
	}
}

func TestRangeHas(t *testing.T) {
	r := NetnsDefault()
	for p, want := range map[int]bool{32767: false, 32768: true, 45000: true, 60999: true, 61000: false} {
		if r.Has(p) != want {
			t.Errorf("%v.Has(%d) = %v, want %v", r, p, !want, want)
		}
	}
}
