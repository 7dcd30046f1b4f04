package atomicfile

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

type failingReader struct{}

func (failingReader) Read([]byte) (int, error) { return 0, errors.New("network gone") }

func TestWrite(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	if err := WriteBytes(p, []byte("old"), Options{Perm: 0o640, UID: -1}); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(p); fi.Mode().Perm() != 0o640 {
		t.Fatalf("mode %v", fi.Mode())
	}
	// A failed source or an empty one (when rejected) leaves the old file
	// and no temp file behind.
	if _, err := Write(p, failingReader{}, Options{Perm: 0o644, UID: -1}); err == nil {
		t.Fatal("read error must fail")
	}
	if _, err := Write(p, strings.NewReader(""), Options{Perm: 0o644, UID: -1, RejectEmpty: true}); err == nil {
		t.Fatal("empty must fail when rejected")
	}
	if b, _ := os.ReadFile(p); string(b) != "old" {
		t.Fatalf("old content lost: %q", b)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 1 {
		t.Fatalf("temp files left: %v", entries)
	}
	if err := WriteBytes(p, nil, Options{Perm: 0o600, UID: -1, SyncDir: true}); err != nil {
		t.Fatal("empty is fine unless rejected:", err)
	}
	if b, _ := os.ReadFile(p); len(b) != 0 {
		t.Fatal("not replaced")
	}
	if m, _ := filepath.Match(TempPattern(p), ".f.tmp-123"); !m {
		t.Fatal("leftovers must match TempPattern")
	}
}
