package ctl

import (
	"context"
	"strings"
	"testing"
)

func TestCopyTarget(t *testing.T) {
	for _, c := range []struct {
		arg, task, path string
		remote          bool
	}{
		{"train:/workflow/data", "train", "/workflow/data", true},
		{"train:", "train", "", true}, // the login's home, as scp reads host:
		{"a1b2c3:rel/p", "a1b2c3", "rel/p", true},
		{"./a:b", "", "./a:b", false},       // a local path with a colon, as docker cp
		{"/abs/x:y", "", "/abs/x:y", false}, // absolute: local
		{"data.bin", "", "data.bin", false},
		{"with space:x", "", "with space:x", false}, // no task is named so
		{":x", "", ":x", false},
		{"", "", "", false},
	} {
		task, path, remote := CopyTarget(c.arg)
		if task != c.task || path != c.path || remote != c.remote {
			t.Errorf("CopyTarget(%q) = %q %q %v, want %q %q %v", c.arg, task, path, remote, c.task, c.path, c.remote)
		}
	}
}

func TestLocalForSCP(t *testing.T) {
	for in, want := range map[string]string{
		"data.bin":     "data.bin",
		"with space:x": "./with space:x", // scp would take "with space" for a host
		"dir/a:b":      "dir/a:b",        // a slash before the colon: scp reads it local
		"/abs:x":       "/abs:x",
	} {
		if got := localForSCP(in); got != want {
			t.Errorf("localForSCP(%q) = %q, want %q", in, got, want)
		}
	}
}

// Both sides local, or both in tasks: refused before any shim is asked.
func TestSCPCommandNeedsOneTask(t *testing.T) {
	for _, args := range [][2]string{{"a", "b"}, {"t1:/x", "t2:/y"}} {
		_, err := testClient(t, Config{Shim: "127.0.0.1:1"}).SCPCommand(context.Background(), SSHOptions{}, args[0], args[1])
		if err == nil || !strings.Contains(err.Error(), "exactly one side") {
			t.Errorf("%q: %v", args, err)
		}
	}
}

// A tar stream (-) pairs with one TASK:PATH, refused before any shim is
// asked otherwise.
func TestTarStreamCommandNeedsOneTask(t *testing.T) {
	for _, args := range [][2]string{{"-", "-"}, {"-", "./local"}, {"/tmp/x", "-"}} {
		_, err := testClient(t, Config{Shim: "127.0.0.1:1"}).CopyCommand(context.Background(), SSHOptions{}, args[0], args[1])
		if err == nil || !strings.Contains(err.Error(), "TASK:PATH") {
			t.Errorf("%q: %v", args, err)
		}
	}
}
