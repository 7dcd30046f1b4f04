package repo

import (
	"archive/tar"
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"
)

type entry struct {
	name, body, link string
	typ              byte
	mode             int64
}

func mkTar(t *testing.T, entries ...entry) *bytes.Buffer {
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

func FuzzExtractTar(f *testing.F) {
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		top := t.TempDir()
		_ = ExtractTar(bytes.NewReader(b), filepath.Join(top, "d"), Owner{UID: -1})
		entries, _ := os.ReadDir(top)
		if len(entries) > 1 {
			t.Fatalf("wrote outside the destination: %v", entries)
		}
	})
}
