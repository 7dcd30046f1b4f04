package testenv

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Dockerd is a dockerd of a test's own: its socket, data and exec roots in
// Dir.
type Dockerd struct {
	Dir  string
	Host string // unix://… for DOCKER_HOST
	Pid  int
}

// StartDockerd starts a dockerd of the test's own through wrap (e.g. a
// Host's Wrap; nil: here), with extra flags, and waits up to wait for it
// to answer. Never pass --bridge=none: that makes dockerd delete docker0,
// the machine daemon's bridge, under every other test. It goes with the
// test (its process group killed, its dir unmounted and removed).
func StartDockerd(t testing.TB, wrap []string, wait time.Duration, extra ...string) *Dockerd {
	t.Helper()
	dir, err := os.MkdirTemp("", "tandem-dockerd-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unmountUnder(dir); _ = os.RemoveAll(dir) })
	d := &Dockerd{Dir: dir, Host: "unix://" + filepath.Join(dir, "d.sock")}
	argv := append(append([]string{}, wrap...), "dockerd", "--host", d.Host, "--data-root", filepath.Join(dir, "root"), "--exec-root", filepath.Join(dir, "exec"),
		"--pidfile", filepath.Join(dir, "d.pid"), "--iptables=false", "--ip-masq=false")
	cmd := exec.Command(argv[0], append(argv[1:], extra...)...)
	logf, _ := os.Create(filepath.Join(dir, "dockerd.log"))
	cmd.Stdout, cmd.Stderr = logf, logf
	t.Cleanup(func() { logf.Close() })
	StartDaemon(t, cmd)
	d.Pid = cmd.Process.Pid
	deadline := time.Now().Add(wait)
	for {
		c := exec.CommandContext(context.Background(), "docker", "info")
		c.Env = append(os.Environ(), "DOCKER_HOST="+d.Host)
		if c.Run() == nil {
			return d
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(filepath.Join(dir, "dockerd.log"))
			t.Fatalf("dockerd did not start:\n%s", tail(b, 30))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// unmountUnder detaches every mount at or below dir, deepest first: dockerd
// bind-mounts its data root onto itself and keeps netns files under its
// exec root, and `umount -R dir` does nothing when dir itself is no mount
// point, which left each test's dockerd dir behind.
func unmountUnder(dir string) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return
	}
	var points []string
	for _, line := range strings.Split(string(b), "\n") {
		// id parent major:minor root mountpoint ...
		if f := strings.Fields(line); len(f) > 4 && (f[4] == dir || strings.HasPrefix(f[4], dir+"/")) {
			points = append(points, f[4])
		}
	}
	slices.SortFunc(points, func(a, b string) int { return len(b) - len(a) })
	for _, p := range points {
		_ = unix.Unmount(p, unix.MNT_DETACH)
	}
}
