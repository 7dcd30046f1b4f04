package testenv

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
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
	t.Cleanup(func() { _ = exec.Command("umount", "-R", "-l", dir).Run(); _ = os.RemoveAll(dir) })
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
