package repo

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tandem-run/tandem/api"
)

func TestSetupRepoDirRules(t *testing.T) {
	blob := filepath.Join(t.TempDir(), "blob")
	if err := os.WriteFile(blob, mkTar(t, entry{name: "main.py", body: "print(1)\n"}).Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	spec := func(dir, exists string) Spec {
		return Spec{Dir: dir, Type: api.RepoLocal, Blob: blob, HasBlob: true, Exists: exists, Owner: Owner{UID: -1}}
	}
	// A fresh volume holding only lost+found counts as empty; lost+found stays.
	vol := filepath.Join(t.TempDir(), "vol")
	_ = os.MkdirAll(filepath.Join(vol, "lost+found"), 0o700)
	_ = os.WriteFile(filepath.Join(vol, "lost+found", "#123"), []byte("fsck"), 0o600)
	if err := Setup(spec(vol, "error")); err != nil {
		t.Fatalf("lost+found only: %v", err)
	}
	if b, _ := os.ReadFile(filepath.Join(vol, "main.py")); string(b) != "print(1)\n" {
		t.Fatal("code not extracted")
	}
	if b, _ := os.ReadFile(filepath.Join(vol, "lost+found", "#123")); string(b) != "fsck" {
		t.Fatal("lost+found must be put back with its content")
	}
	// A non-empty dir: error or skip.
	full := t.TempDir()
	_ = os.WriteFile(filepath.Join(full, "mine.txt"), []byte("keep"), 0o644)
	if err := Setup(spec(full, "error")); err == nil || !strings.Contains(err.Error(), "repo dir is not empty") {
		t.Fatalf("error action: %v", err)
	}
	if err := Setup(spec(full, "skip")); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(full, "main.py")); !os.IsNotExist(err) {
		t.Fatal("skip must leave the dir alone")
	}
	if err := Setup(Spec{Dir: t.TempDir(), Type: "svn", Owner: Owner{UID: -1}}); err == nil || !strings.Contains(err.Error(), "unknown RepoType") {
		t.Fatalf("unknown type: %v", err)
	}
	if err := Setup(Spec{Dir: t.TempDir(), Type: api.RepoRemote, Owner: Owner{UID: -1}}); err == nil {
		t.Fatal("a remote repo without credentials must fail cleanly")
	}
}
