package ident

import (
	"strings"
	"testing"
)

func TestRules(t *testing.T) {
	good := []string{"0b5c5c3e-8f4a-4b7e-9d8e-1c2b3a4d5e6f", "t1", "my-run-0-0", "A.b_c"}
	bad := []string{"", "..", ".", "a/b", "a\nb", "a\x00b", "-x", ".hidden", "a b", "a\\b", strings.Repeat("a", 300), "ü"}
	for _, s := range good {
		if err := TaskID(s); err != nil {
			t.Errorf("TaskID(%q): %v", s, err)
		}
		if err := ArchiveID(s); err != nil {
			t.Errorf("ArchiveID(%q): %v", s, err)
		}
	}
	for _, s := range bad {
		if TaskID(s) == nil || ArchiveID(s) == nil || VolumeName(s) == nil || TaskName(s) == nil {
			t.Errorf("%q accepted", s)
		}
	}
	for _, s := range []string{"my-volume", "data01", "vol.v2"} {
		if err := VolumeName(s); err != nil {
			t.Errorf("VolumeName(%q): %v", s, err)
		}
	}
	for _, s := range []string{"My-Volume", "../../victim", strings.Repeat("v", 65)} {
		if VolumeName(s) == nil {
			t.Errorf("VolumeName(%q) accepted", s)
		}
	}
	if err := TaskID("a\nb"); err == nil || !strings.Contains(err.Error(), `'\n'`) {
		t.Errorf("message does not name the byte: %v", err)
	}
}

func FuzzTaskID(f *testing.F) {
	f.Add("0b5c5c3e-8f4a-4b7e-9d8e-1c2b3a4d5e6f")
	f.Add("../x")
	f.Fuzz(func(t *testing.T, s string) {
		if TaskID(s) != nil {
			return
		}
		if len(s) > MaxID || strings.ContainsAny(s, "/\\\x00\n\r ") || s == "." || s == ".." || s[0] == '.' {
			t.Fatalf("accepted %q", s)
		}
	})
}
