package executor

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestMkdirOwnedNeverFollowsPlantedLinks(t *testing.T) {
	top := t.TempDir()
	outside := filepath.Join(top, "outside")
	// A dangling link where the working dir would be created.
	_ = os.Symlink(filepath.Join(outside, "made"), filepath.Join(top, "wd"))
	err := MkdirOwned(filepath.Join(top, "wd", "sub"), os.Getuid(), os.Getgid())
	if err == nil || !strings.Contains(err.Error(), "symlink") {
		t.Fatalf("dangling link: %v", err)
	}
	if _, err := os.Stat(outside); err == nil {
		t.Fatal("a directory was created through the link")
	}
	// The normal case: every missing component created.
	if err := MkdirOwned(filepath.Join(top, "a", "b", "c"), os.Getuid(), os.Getgid()); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(filepath.Join(top, "a", "b", "c")); err != nil || !fi.IsDir() {
		t.Fatalf("created: %v", err)
	}
	// Existing links made by the image are followed (e.g. /home -> /usr/home).
	_ = os.Symlink(filepath.Join(top, "a"), filepath.Join(top, "alias"))
	if err := MkdirOwned(filepath.Join(top, "alias", "d"), os.Getuid(), os.Getgid()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(top, "a", "d")); err != nil {
		t.Fatal(err)
	}
}

func TestHomeFileStaysInHome(t *testing.T) {
	top := t.TempDir()
	home, victimDir := filepath.Join(top, "home"), filepath.Join(top, "root-ssh")
	_ = os.MkdirAll(home, 0o755)
	_ = os.MkdirAll(victimDir, 0o700)
	victim := filepath.Join(victimDir, "authorized_keys")
	_ = os.WriteFile(victim, []byte("root's key\n"), 0o600)

	// ~/.ssh planted as a link to another user's .ssh.
	_ = os.Symlink(victimDir, filepath.Join(home, ".ssh"))
	err := homeFile(home, ".ssh/authorized_keys", []byte("attacker\n"), 0o600, -1, -1, true)
	if err == nil {
		t.Fatal("wrote through a link leading out of home")
	}
	if b, _ := os.ReadFile(victim); string(b) != "root's key\n" {
		t.Fatalf("victim changed: %q", b)
	}

	// The final component planted as a link: replaced, never written through.
	_ = os.Remove(filepath.Join(home, ".ssh"))
	_ = os.MkdirAll(filepath.Join(home, ".ssh"), 0o700)
	_ = os.Symlink(victim, filepath.Join(home, ".ssh", "dstack_job"))
	if err := homeFile(home, ".ssh/dstack_job", []byte("key\n"), 0o600, -1, -1, false); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(victim); string(b) != "root's key\n" {
		t.Fatalf("victim changed: %q", b)
	}
	if fi, _ := os.Lstat(filepath.Join(home, ".ssh", "dstack_job")); fi == nil || !fi.Mode().IsRegular() {
		t.Fatal("key file is not a regular file")
	}
	// Appending through a final link is refused.
	_ = os.Symlink(victim, filepath.Join(home, ".ssh", "config"))
	if err := homeFile(home, ".ssh/config", []byte("Host x\n"), 0o600, -1, -1, true); err == nil {
		t.Fatal("appended through a link")
	}
	if b, _ := os.ReadFile(victim); string(b) != "root's key\n" {
		t.Fatalf("victim changed: %q", b)
	}
}
