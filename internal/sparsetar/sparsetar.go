// Package sparsetar gives tests GNU tar's own sparse archives: a few KiB
// that describe a 512 MiB file (one hole and three bytes), the input that
// must never be expanded on extraction.
package sparsetar

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// Size is the size of the file the archive describes.
const Size = 512 << 20

// Archive returns a sparse archive of one file named "hole" in format
// ("gnu" or "pax"), made by the system's GNU tar.
func Archive(t testing.TB, format string) []byte {
	t.Helper()
	src := t.TempDir()
	f, err := os.Create(filepath.Join(src, "hole"))
	if err != nil {
		t.Fatal(err)
	}
	_ = f.Truncate(Size)
	_, _ = f.WriteAt([]byte("end"), Size-3)
	f.Close()
	var out, errb bytes.Buffer
	cmd := exec.Command("tar", "--format="+format, "--sparse", "-C", src, "-cf", "-", "hole")
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		t.Fatalf("tar: %v %s", err, errb.Bytes())
	}
	if out.Len() > 64<<10 {
		t.Fatalf("the %s archive is %d bytes: not sparse", format, out.Len())
	}
	return out.Bytes()
}
