package repo

import (
	"archive/tar"
	"bytes"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tandem-run/tandem/internal/sparsetar"
)

type entry struct {
	name, body, link string
	typ              byte
	mode             int64
}

func mkTar(t testing.TB, entries ...entry) *bytes.Buffer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		typ := e.typ
		if typ == 0 {
			typ = tar.TypeReg
		}
		mode := e.mode
		if mode == 0 {
			mode = 0o644
		}
		h := &tar.Header{Name: e.name, Typeflag: typ, Mode: mode, Size: int64(len(e.body)), Linkname: e.link}
		if typ != tar.TypeReg {
			h.Size = 0
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if typ == tar.TypeReg {
			_, _ = tw.Write([]byte(e.body))
		}
	}
	_ = tw.Close()
	return &buf
}

func read(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestExtractTarTree(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "repo")
	tr := mkTar(t,
		entry{name: "./", typ: tar.TypeDir, mode: 0o755},
		entry{name: "src/", typ: tar.TypeDir, mode: 0o755},
		entry{name: "src/main.py", body: "print(1)\n"},
		entry{name: "run.sh", body: "#!/bin/sh\n", mode: 0o755},
		entry{name: "link", typ: tar.TypeSymlink, link: "src/main.py"},
		entry{name: "hard", typ: tar.TypeLink, link: "run.sh"},
	)
	if err := ExtractTar(tr, dir, Owner{UID: -1}); err != nil {
		t.Fatal(err)
	}
	if read(t, filepath.Join(dir, "link")) != "print(1)\n" || read(t, filepath.Join(dir, "hard")) != "#!/bin/sh\n" {
		t.Fatal("links")
	}
	if fi, _ := os.Stat(filepath.Join(dir, "run.sh")); fi.Mode().Perm() != 0o755 {
		t.Fatalf("mode %v", fi.Mode())
	}
}

func TestExtractRejectsEscapes(t *testing.T) {
	tests := []struct {
		name    string
		entries []entry
	}{
		{"dot-dot", []entry{{name: "../evil", body: "x"}}},
		{"nested dot-dot", []entry{{name: "a/../../evil", body: "x"}}},
		{"absolute", []entry{{name: "/evil", body: "x"}}},
		{"write through symlink to outside", []entry{{name: "out", typ: tar.TypeSymlink, link: "../outside"}, {name: "out/evil", body: "x"}}},
		{"write through absolute symlink", []entry{{name: "out", typ: tar.TypeSymlink, link: "/"}, {name: "out/evil", body: "x"}}},
		{"hardlink outside", []entry{{name: "h", typ: tar.TypeLink, link: "../outside/victim"}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			top := t.TempDir()
			outside := filepath.Join(top, "outside")
			_ = os.Mkdir(outside, 0o755)
			_ = os.WriteFile(filepath.Join(outside, "victim"), []byte("safe"), 0o644)
			err := ExtractTar(mkTar(t, tc.entries...), filepath.Join(top, "dest"), Owner{UID: -1})
			if !errors.Is(err, ErrUnsafePath) {
				t.Fatalf("want ErrUnsafePath, got %v", err)
			}
			for _, p := range []string{filepath.Join(top, "evil"), filepath.Join(outside, "evil"), "/evil"} {
				if _, err := os.Lstat(p); err == nil {
					t.Fatalf("%s was written", p)
				}
			}
			if read(t, filepath.Join(outside, "victim")) != "safe" {
				t.Fatal("victim changed")
			}
		})
	}
}

func TestExtractArchiveRenamesFirstComponent(t *testing.T) {
	top := t.TempDir()
	// A directory "data" uploaded to ~/inputs.
	dest := filepath.Join(top, "home", "inputs")
	_ = os.MkdirAll(dest, 0o755)
	_ = os.WriteFile(filepath.Join(dest, "stale"), []byte("old"), 0o644)
	err := ExtractArchive(mkTar(t,
		entry{name: "data", typ: tar.TypeDir, mode: 0o755},
		entry{name: "data/a.txt", body: "A"},
		entry{name: "data/sub/b.txt", body: "B"},
	), dest, Owner{UID: -1})
	if err != nil {
		t.Fatal(err)
	}
	if read(t, filepath.Join(dest, "a.txt")) != "A" || read(t, filepath.Join(dest, "sub", "b.txt")) != "B" {
		t.Fatal("tree")
	}
	if _, err := os.Stat(filepath.Join(dest, "stale")); !os.IsNotExist(err) {
		t.Fatal("destination must be replaced")
	}
	// A single file "config.yaml" uploaded to /x/app.yaml.
	file := filepath.Join(top, "x", "app.yaml")
	if err := ExtractArchive(mkTar(t, entry{name: "config.yaml", body: "k: v\n", mode: 0o600}), file, Owner{UID: -1}); err != nil {
		t.Fatal(err)
	}
	if read(t, file) != "k: v\n" {
		t.Fatal("single file")
	}
	// A symlink in the tree cannot carry later entries out of dest.
	err = ExtractArchive(mkTar(t,
		entry{name: "d", typ: tar.TypeDir},
		entry{name: "d/up", typ: tar.TypeSymlink, link: ".."},
		entry{name: "d/up/escaped", body: "x"},
	), filepath.Join(top, "y", "d"), Owner{UID: -1})
	if !errors.Is(err, ErrUnsafePath) {
		t.Fatalf("symlink escape: %v", err)
	}
	if _, err := os.Stat(filepath.Join(top, "y", "escaped")); err == nil {
		t.Fatal("escaped file written next to dest")
	}
}

// FuzzExtractTar asserts confinement and the size bound: with sparse
// entries refused, the bytes on disk never exceed the bytes of the archive.
func FuzzExtractTar(f *testing.F) {
	f.Add([]byte{})
	f.Add(mkTarBytes(f, entry{name: "a", body: "hello"}, entry{name: "l", typ: tar.TypeLink, link: "a"}))
	f.Fuzz(func(t *testing.T, b []byte) {
		top := t.TempDir()
		_ = ExtractTar(bytes.NewReader(b), filepath.Join(top, "d"), Owner{UID: -1})
		entries, _ := os.ReadDir(top)
		if len(entries) > 1 {
			t.Fatalf("wrote outside the destination: %v", entries)
		}
		_ = filepath.WalkDir(top, func(p string, d fs.DirEntry, err error) error {
			if err == nil && d.Type().IsRegular() {
				if fi, err := d.Info(); err == nil {
					if fi.Size() > int64(len(b)) {
						t.Fatalf("%s is %d bytes from a %d-byte archive", p, fi.Size(), len(b))
					}
				}
			}
			return nil
		})
	})
}

func mkTarBytes(t testing.TB, entries ...entry) []byte {
	b, err := io.ReadAll(mkTar(t, entries...))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestSparseEntriesRefused: GNU tar's own sparse archives (old GNU and PAX
// formats) of a 512 MiB file that is one hole: a few KiB that would expand.
func TestSparseEntriesRefused(t *testing.T) {
	for _, format := range []string{"gnu", "pax"} {
		t.Run(format, func(t *testing.T) {
			f := bytes.NewReader(sparsetar.Archive(t, format))
			dest := filepath.Join(t.TempDir(), "d")
			err := ExtractTar(f, dest, Owner{UID: -1})
			if !errors.Is(err, ErrUnsafePath) || !strings.Contains(err.Error(), "sparse") {
				t.Fatalf("sparse %s archive: %v", format, err)
			}
			if _, err := os.Stat(filepath.Join(dest, "hole")); err == nil {
				t.Fatal("the sparse file was written")
			}
		})
	}
}

func TestExtractLimits(t *testing.T) {
	lim := Limits{MaxBytes: 10, MaxEntries: 3}
	err := extractTar(mkTar(t, entry{name: "a", body: "123456"}, entry{name: "b", body: "123456"}), t.TempDir(), Owner{UID: -1}, lim)
	if !errors.Is(err, ErrTooBig) || !strings.Contains(err.Error(), `"b"`) {
		t.Fatalf("bytes: %v", err)
	}
	err = extractTar(mkTar(t, entry{name: "a"}, entry{name: "b"}, entry{name: "c"}, entry{name: "d"}), t.TempDir(), Owner{UID: -1}, lim)
	if !errors.Is(err, ErrTooBig) || !strings.Contains(err.Error(), "3 entries") {
		t.Fatalf("entries: %v", err)
	}
	if err := extractArchive(mkTar(t, entry{name: "a", body: "1234567890"}), filepath.Join(t.TempDir(), "f"), Owner{UID: -1}, lim); err != nil {
		t.Fatalf("at the limit: %v", err)
	}
}

// TestArchiveHardLinks: the client archives "src/f" and "src/g" -> src/f;
// the link target is renamed with the first component, as names are.
func TestArchiveHardLinks(t *testing.T) {
	dest := filepath.Join(t.TempDir(), "inputs")
	err := ExtractArchive(mkTar(t,
		entry{name: "src", typ: tar.TypeDir, mode: 0o755},
		entry{name: "src/f", body: "data"},
		entry{name: "src/g", typ: tar.TypeLink, link: "src/f"},
	), dest, Owner{UID: -1})
	if err != nil {
		t.Fatal(err)
	}
	a, _ := os.Stat(filepath.Join(dest, "f"))
	b, _ := os.Stat(filepath.Join(dest, "g"))
	if a == nil || b == nil || !os.SameFile(a, b) || read(t, filepath.Join(dest, "g")) != "data" {
		t.Fatal("g is not a hard link to f")
	}
	// A link reaching outside the tree is refused.
	err = ExtractArchive(mkTar(t,
		entry{name: "src", typ: tar.TypeDir, mode: 0o755},
		entry{name: "src/g", typ: tar.TypeLink, link: "../etc/passwd"},
	), filepath.Join(t.TempDir(), "x"), Owner{UID: -1})
	if !errors.Is(err, ErrUnsafePath) {
		t.Fatalf("escaping link: %v", err)
	}
}
