package authkeys

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestAddRemoveOnlyOurLines(t *testing.T) {
	home := t.TempDir()
	e := &Editor{HomeDir: func(string) (string, int, int, error) { return home, os.Getuid(), os.Getgid(), nil }}
	path := filepath.Join(home, ".ssh", "authorized_keys")

	// Missing ~/.ssh and file are created.
	if err := e.Add("ubuntu", "t1", []string{"ssh-ed25519 AAAAshared user@laptop", "", "bad\nkey"}); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("created file: %v %v", fi, err)
	}
	if di, _ := os.Stat(filepath.Dir(path)); di.Mode().Perm() != 0o700 {
		t.Fatalf(".ssh mode %v", di.Mode().Perm())
	}
	// The user adds the same key by hand; a second task adds it too.
	f, _ := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	_, _ = f.WriteString("ssh-ed25519 AAAAshared user@laptop\n")
	f.Close()
	if err := e.Add("ubuntu", "t2", []string{"ssh-ed25519 AAAAshared user@laptop"}); err != nil {
		t.Fatal(err)
	}
	if err := e.Add("ubuntu", "t2", []string{"ssh-ed25519 AAAAshared user@laptop"}); err != nil {
		t.Fatal(err)
	}
	want := "ssh-ed25519 AAAAshared user@laptop # tandem task t1\n" +
		"ssh-ed25519 AAAAshared user@laptop\n" +
		"ssh-ed25519 AAAAshared user@laptop # tandem task t2\n"
	if b, _ := os.ReadFile(path); string(b) != want {
		t.Fatalf("after adds:\n%s", b)
	}
	if err := e.Remove("ubuntu", "t1"); err != nil {
		t.Fatal(err)
	}
	if err := e.Remove("ubuntu", "t1"); err != nil {
		t.Fatal("remove is idempotent:", err)
	}
	want = "ssh-ed25519 AAAAshared user@laptop\nssh-ed25519 AAAAshared user@laptop # tandem task t2\n"
	if b, _ := os.ReadFile(path); string(b) != want {
		t.Fatalf("t1's removal must keep the user's and t2's lines:\n%s", b)
	}
	// A user-chosen mode survives rewrites.
	_ = os.Chmod(path, 0o644)
	_ = e.Remove("ubuntu", "t2")
	if fi, _ := os.Stat(path); fi.Mode().Perm() != 0o644 {
		t.Fatalf("mode not preserved: %v", fi.Mode().Perm())
	}
}

func TestRefusesPlantedLinks(t *testing.T) {
	top := t.TempDir()
	home, rootSSH := filepath.Join(top, "home"), filepath.Join(top, "root-ssh")
	_ = os.MkdirAll(home, 0o755)
	_ = os.MkdirAll(rootSSH, 0o700)
	victim := filepath.Join(rootSSH, "authorized_keys")
	_ = os.WriteFile(victim, []byte("root\n"), 0o600)
	e := &Editor{HomeDir: func(string) (string, int, int, error) { return home, os.Getuid(), os.Getgid(), nil }}

	_ = os.Symlink(rootSSH, filepath.Join(home, ".ssh"))
	if err := e.Add("u", "t1", []string{"ssh-ed25519 AAAAx"}); err == nil || !strings.Contains(err.Error(), "symlink") {
		t.Fatalf("~/.ssh as a link: %v", err)
	}
	_ = os.Remove(filepath.Join(home, ".ssh"))
	_ = os.Mkdir(filepath.Join(home, ".ssh"), 0o700)
	_ = os.Symlink(victim, filepath.Join(home, ".ssh", "authorized_keys"))
	if err := e.Add("u", "t1", []string{"ssh-ed25519 AAAAx"}); err == nil || !strings.Contains(err.Error(), "symlink") {
		t.Fatalf("authorized_keys as a link: %v", err)
	}
	if b, _ := os.ReadFile(victim); string(b) != "root\n" {
		t.Fatalf("victim changed: %q", b)
	}
	// A real file in a real directory still works, through the descriptor.
	_ = os.Remove(filepath.Join(home, ".ssh", "authorized_keys"))
	if err := e.Add("u", "t1", []string{"ssh-ed25519 AAAAx"}); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(home, ".ssh", "authorized_keys")); string(b) != "ssh-ed25519 AAAAx # tandem task t1\n" {
		t.Fatalf("written: %q", b)
	}
}
