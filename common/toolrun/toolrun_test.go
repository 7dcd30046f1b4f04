//go:build linux

package toolrun

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tandem-run/tandem/common/procs"
)

// TestRunBounds: each bound ends the run with its error, an exit status
// reaches the caller, and nothing the program started outlives the run.
func TestRunBounds(t *testing.T) {
	dir := t.TempDir()
	pidFile := filepath.Join(dir, "child")
	b := Bounds{Timeout: 2 * time.Second, Stdout: 1024, Stderr: 8, WaitDelay: 200 * time.Millisecond, Env: []string{"TOOLRUN_X=1"}}
	for _, c := range []struct {
		name   string
		script string
		want   error
		out    string
		errOut string
	}{
		{"an answer", `echo "$TOOLRUN_X ok"; echo noise-beyond-eight >&2`, nil, "1 ok\n", "noise-be"},
		{"a hang", `sleep 60`, ErrTimeout, "", ""},
		{"a flood", `while :; do echo xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx; done`, ErrOutput, "", ""},
		{"a child holding the pipe after an answer", `echo done; (sleep 60; echo late) & echo $! > ` + pidFile, nil, "done\n", ""},
		{"a failure", `exit 3`, nil, "", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			_ = os.Remove(pidFile)
			start := time.Now()
			out, errOut, err := Run(context.Background(), b, "/bin/sh", "-c", c.script)
			if time.Since(start) > 10*time.Second {
				t.Fatalf("the run took %s", time.Since(start))
			}
			switch {
			case c.name == "a failure":
				var exit *exec.ExitError
				if !errors.As(err, &exit) || exit.ExitCode() != 3 {
					t.Fatalf("exit status: %v", err)
				}
			case c.want != nil:
				if !errors.Is(err, c.want) {
					t.Fatalf("err %v, want %v", err, c.want)
				}
			case err != nil || string(out) != c.out || string(errOut) != c.errOut:
				t.Fatalf("%q %q %v, want %q %q", out, errOut, err, c.out, c.errOut)
			}
			if b, err := os.ReadFile(pidFile); err == nil {
				pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
				if pid > 0 && alive(pid) {
					_ = syscall.Kill(pid, syscall.SIGKILL)
					t.Fatalf("the program's child (pid %d) outlived the run", pid)
				}
			}
		})
	}
	if _, _, err := Run(context.Background(), b, "no-such-tool-here"); !errors.Is(err, exec.ErrNotFound) {
		t.Fatalf("a missing program: %v", err)
	}
}

// alive reports whether pid runs (a zombie waiting to be reaped is dead),
// waiting up to 2 s for the kill to land.
func alive(pid int) bool {
	for end := time.Now().Add(2 * time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		if f, err := procs.StatFields(filepath.Join("/proc", strconv.Itoa(pid))); err != nil || f[0] == "Z" {
			return false
		}
	}
	return true
}
