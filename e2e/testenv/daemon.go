package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Daemons the tests start run in their own process group, inherit only
// stdin, stdout and stderr, and are killed as a group in t.Cleanup. A
// daemon that forks (git daemon, dockerd's containerd) cannot outlive its
// test, and none holds a descriptor of the test run (a pipe `go test`
// waits on would hang CI).

var (
	daemonsMu sync.Mutex
	daemons   = map[int]string{} // process group → what it is
)

// cloexecAll marks every descriptor above stderr close-on-exec in this
// process: Go's own are already, but ones inherited from the parent (a CI
// harness's pipe) are not, and exec would hand them to every child.
var cloexecOnce sync.Once

func cloexecAll() {
	cloexecOnce.Do(func() {
		if err := unix.CloseRange(3, ^uint(0), unix.CLOSE_RANGE_CLOEXEC); err == nil {
			return
		}
		entries, _ := os.ReadDir("/proc/self/fd")
		for _, e := range entries {
			if fd, err := strconv.Atoi(e.Name()); err == nil && fd > 2 {
				unix.CloseOnExec(fd)
			}
		}
	})
}

// Isolate puts cmd in its own process group and makes sure it inherits
// only stdin/stdout/stderr and cmd.ExtraFiles; for processes whose
// lifecycle the caller manages itself (the shim under test, a dockerd that
// must outlive the test).
func Isolate(cmd *exec.Cmd) {
	cloexecAll()
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Setpgid = true
}

// StartDaemon starts cmd as a test daemon: its own process group, only
// stdin/stdout/stderr (and cmd.ExtraFiles) inherited, the whole group
// killed when t ends.
func StartDaemon(t testing.TB, cmd *exec.Cmd) {
	t.Helper()
	Isolate(cmd)
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", cmd.Path, err)
	}
	pgid := cmd.Process.Pid
	daemonsMu.Lock()
	daemons[pgid] = strings.Join(cmd.Args, " ")
	daemonsMu.Unlock()
	waited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(waited) }()
	t.Cleanup(func() {
		_ = syscall.Kill(-pgid, syscall.SIGKILL)
		select {
		case <-waited:
		case <-time.After(10 * time.Second):
		}
		// The group is empty once every member is reaped or reparented
		// and killed; wait for that too.
		for i := 0; i < 100 && syscall.Kill(-pgid, 0) == nil; i++ {
			time.Sleep(20 * time.Millisecond)
		}
		daemonsMu.Lock()
		delete(daemons, pgid)
		daemonsMu.Unlock()
	})
}

// LeftoverDaemons lists process groups of test daemons that still have a
// live member; TestMain calls it after the suite.
func LeftoverDaemons() []string {
	daemonsMu.Lock()
	defer daemonsMu.Unlock()
	var out []string
	for pgid, what := range daemons {
		if syscall.Kill(-pgid, 0) == nil {
			out = append(out, fmt.Sprintf("pgid %d: %s", pgid, what))
		}
	}
	return out
}

// KillPid sends SIGKILL to the process pid (a decimal string), for cleanups
// of daemons a test started out of its reach (e.g. over SSH with setsid).
func KillPid(pid string) error {
	n, err := strconv.Atoi(pid)
	if err != nil || n <= 1 {
		return fmt.Errorf("pid %q", pid)
	}
	return syscall.Kill(n, syscall.SIGKILL)
}
