package cli

import (
	"testing"

	"github.com/tandem-run/tandem/api"
)

func TestParseSizeAndGPUs(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
		ok   bool
	}{
		{"", 0, true}, {"512MiB", 512 << 20, true}, {"8GiB", 8 << 30, true}, {"1.5G", 3 << 29, true},
		{"2GB", 2e9, true}, {"100", 100, true}, {"-1G", 0, false}, {"lots", 0, false}, {"8 GiB", 8 << 30, true},
	} {
		got, err := parseSize(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("parseSize(%q) = %d, %v", tc.in, got, err)
		}
	}
	for in, want := range map[string]int{"0": 0, "2": 2, "all": -1} {
		if got, err := parseGPUs(in); err != nil || got != want {
			t.Errorf("parseGPUs(%q) = %d, %v", in, got, err)
		}
	}
	if _, err := parseGPUs("-3"); err == nil {
		t.Error("negative GPU counts must be rejected")
	}
}

// TestAliasCannotShadowAHost: every alias carries the tandem- prefix and no
// dot, so a task named for a real host or an address cannot take over
// `ssh NAME`; a bad name falls back to the short id.
func TestAliasCannotShadowAHost(t *testing.T) {
	for name, want := range map[string]string{"train-1": "tandem-train-1", "github.com": "tandem-github-com", "10.0.0.1": "tandem-10-0-0-1",
		"prod": "tandem-prod", "": "tandem-abcdef12", "bad\nHost *": "tandem-abcdef12", "a b": "tandem-abcdef12"} {
		info := api.TaskInfoResponse{ID: "abcdef12-0000", Tandem: &api.TaskDetails{Name: name}}
		if got := alias(info); got != want {
			t.Errorf("alias(%q) = %q, want %q", name, got, want)
		}
	}
}
