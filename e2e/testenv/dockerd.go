package testenv

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
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
	argv []string
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
	t.Cleanup(func() { killShimsUnder(dir); unmountUnder(dir); _ = os.RemoveAll(dir) })
	d := &Dockerd{Dir: dir, Host: "unix://" + filepath.Join(dir, "d.sock")}
	argv := append(append([]string{}, wrap...), "dockerd", "--host", d.Host, "--data-root", filepath.Join(dir, "root"), "--exec-root", filepath.Join(dir, "exec"),
		"--pidfile", filepath.Join(dir, "d.pid"), "--iptables=false", "--ip-masq=false")
	d.argv = append(argv, extra...)
	d.start(t, wait)
	return d
}

// Restart stops the daemon with SIGTERM as an operator's restart does (its
// containers stop: no live-restore) and starts it again on the same dirs.
func (d *Dockerd) Restart(t testing.TB, wait time.Duration) {
	t.Helper()
	_ = syscall.Kill(d.Pid, syscall.SIGTERM)
	deadline := time.Now().Add(60 * time.Second)
	for syscall.Kill(d.Pid, 0) == nil {
		if time.Now().After(deadline) {
			t.Fatal("dockerd did not stop")
		}
		time.Sleep(50 * time.Millisecond)
	}
	d.start(t, wait)
}

// start runs d's dockerd and waits up to wait for it to answer.
func (d *Dockerd) start(t testing.TB, wait time.Duration) {
	t.Helper()
	dir := d.Dir
	cmd := exec.Command(d.argv[0], d.argv[1:]...)
	logf, _ := os.OpenFile(filepath.Join(dir, "dockerd.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	cmd.Stdout, cmd.Stderr = logf, logf
	t.Cleanup(func() { logf.Close() })
	StartDaemon(t, cmd)
	d.Pid = cmd.Process.Pid
	// Runs before StartDaemon's group kill (cleanups run last first): the
	// daemon removes its containers while it lives. Their containerd shims
	// are daemons of a session of their own, which the group kill misses;
	// killShimsUnder ends any that outlive this (a daemon that hung).
	t.Cleanup(func() { d.removeContainers() })
	deadline := time.Now().Add(wait)
	for {
		c := exec.CommandContext(context.Background(), "docker", "info")
		c.Env = append(os.Environ(), "DOCKER_HOST="+d.Host)
		if c.Run() == nil {
			return
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(filepath.Join(dir, "dockerd.log"))
			t.Fatalf("dockerd did not start:\n%s", tail(b, 30))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// removeContainers removes every container of d's daemon, within 30 s; a
// daemon already gone is fine.
func (d *Dockerd) removeContainers() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	docker := func(args ...string) (string, error) {
		c := exec.CommandContext(ctx, "docker", args...)
		c.Env = append(os.Environ(), "DOCKER_HOST="+d.Host)
		out, err := c.Output()
		return string(out), err
	}
	out, err := docker("ps", "-aq")
	if ids := strings.Fields(out); err == nil && len(ids) > 0 {
		_, _ = docker(append([]string{"rm", "-f"}, ids...)...)
	}
}

// killShimsUnder kills the containerd shims of the test daemon whose exec
// root is under dir (their -address names its socket there), and the
// processes of their containers: they are this test's, started by its
// daemon, and nothing else names that dir.
func killShimsUnder(dir string) {
	procs, _ := os.ReadDir("/proc")
	for _, e := range procs {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		argv := strings.Split(string(b), "\x00")
		if len(argv) == 0 || !strings.HasPrefix(filepath.Base(argv[0]), "containerd-shim") {
			continue
		}
		for i, a := range argv {
			if a == "-address" && i+1 < len(argv) && strings.HasPrefix(argv[i+1], dir+"/") {
				killTree(pid)
				break
			}
		}
	}
}

// killTree SIGKILLs pid's children, then pid.
func killTree(pid int) {
	b, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "task", strconv.Itoa(pid), "children"))
	for _, c := range strings.Fields(string(b)) {
		if n, err := strconv.Atoi(c); err == nil {
			killTree(n)
		}
	}
	_ = syscall.Kill(pid, syscall.SIGKILL)
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
