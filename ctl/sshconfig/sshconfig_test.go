package sshconfig

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

func entry(id, shim, alias string) string {
	return Marker(id, shim) + "\nHost " + alias + "\n  HostName 10.0.0.5\n"
}

func TestPutForgetReplace(t *testing.T) {
	f := File{Path: filepath.Join(t.TempDir(), "sub", "ssh_config")}
	if err := f.Forget("nothing"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(f.Path); !os.IsNotExist(err) {
		t.Fatal("Forget made a file")
	}
	steps := []struct {
		name string
		do   func() error
		want []string // task ids in file order
	}{
		{"put a", func() error { return f.Put("a", "train", entry("a", "s1", "train")) }, []string{"a"}},
		{"put b", func() error { return f.Put("b", "eval", entry("b", "s2", "eval")) }, []string{"b", "a"}},
		{"refresh a", func() error { return f.Put("a", "train", entry("a", "s1", "train")) }, []string{"a", "b"}},
		{"same alias, new task", func() error { return f.Put("c", "train", entry("c", "s1", "train")) }, []string{"c", "b"}},
		{"replace shim s1", func() error { return f.ReplaceShim("s1", []string{entry("d", "s1", "d1"), entry("e", "s1", "e1")}) }, []string{"d", "e", "b"}},
		{"forget e", func() error { return f.Forget("e") }, []string{"d", "b"}},
	}
	for _, s := range steps {
		if err := s.do(); err != nil {
			t.Fatalf("%s: %v", s.name, err)
		}
		b, err := os.ReadFile(f.Path)
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, e := range parse(b) {
			id, _ := EntryTask(e)
			ids = append(ids, id)
		}
		if fmt.Sprint(ids) != fmt.Sprint(s.want) {
			t.Fatalf("%s: entries %v, want %v\n%s", s.name, ids, s.want, b)
		}
		if !strings.HasPrefix(string(b), header) {
			t.Fatalf("%s: no header", s.name)
		}
	}
	if fi, err := os.Stat(f.Path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("mode: %v %v", fi.Mode(), err)
	}
}

// TestConcurrentPuts: the lock keeps every writer's entry.
func TestConcurrentPuts(t *testing.T) {
	f := File{Path: filepath.Join(t.TempDir(), "ssh_config")}
	var wg sync.WaitGroup
	for i := range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id := fmt.Sprintf("t%d", i)
			if err := f.Put(id, "h"+id, entry(id, "s", "h"+id)); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	b, _ := os.ReadFile(f.Path)
	if n := len(parse(b)); n != 20 {
		t.Fatalf("%d entries, want 20\n%s", n, b)
	}
}

func TestInstall(t *testing.T) {
	dir := t.TempDir()
	user := filepath.Join(dir, ".ssh", "config")
	if err := os.MkdirAll(filepath.Dir(user), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(user, []byte("Host old\n  User me\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := Install(user, "/x/ssh_config"); err != nil {
			t.Fatal(err)
		}
	}
	b, _ := os.ReadFile(user)
	if string(b) != "Include /x/ssh_config\n\nHost old\n  User me\n" {
		t.Fatalf("%q", b)
	}
	if fi, _ := os.Stat(user); fi.Mode().Perm() != 0o644 {
		t.Fatalf("mode changed: %v", fi.Mode())
	}
	if !Included(user, "/x/ssh_config") || Included(user, "/y") {
		t.Fatal("Included")
	}
}
