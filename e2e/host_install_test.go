package e2e

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/shimclient"
	"github.com/tandem-run/tandem/e2e/testenv"
)

// TestTandemHostInstall: `tandem host install` over a real OpenSSH server
// puts the agents on "a user's own box" (this machine, under a temporary
// prefix; no systemd here, so the supervisor script runs the shim), a job
// runs through it, a second install changes nothing, an upgrade with a
// task running restarts the shim and keeps the task, and uninstall refuses
// while tasks remain, then removes everything but the shim's home.
func TestTandemHostInstall(t *testing.T) {
	sshd := testenv.StartSSHD(t)
	bins := testenv.Binaries(t)
	img := testenv.Busybox(t)
	prefix := t.TempDir()
	dir := t.TempDir()
	_, shimPort, _ := net.SplitHostPort(testenv.FreeAddr(t))
	_, runnerPort, _ := net.SplitHostPort(testenv.FreeAddr(t))
	_, sshPort, _ := net.SplitHostPort(testenv.FreeAddr(t))
	target := []string{"--ssh", sshd.User + "@" + sshd.Addr, "--identity", sshd.ClientKey, "--known-hosts", sshd.KnownHosts}
	hostArgs := append(append([]string{}, target...), "--prefix", prefix, "--shim-http-port", shimPort,
		"--runner-http-port", runnerPort, "--runner-ssh-port", sshPort)
	install := func(shimBin string) (string, string) {
		t.Helper()
		args := append([]string{"host", "install", "--shim-binary", shimBin, "--runner-binary", bins.Runner}, hostArgs...)
		cmd, out, errb := tandemIn(t, dir, nil, args...)
		if err := cmd.Run(); err != nil {
			t.Fatalf("host install: %v\n%s\n%s", err, out, errb)
		}
		return out.String(), errb.String()
	}
	t.Cleanup(func() {
		cmd, _, _ := tandemIn(t, dir, nil, append([]string{"host", "uninstall", "--force"}, hostArgs...)...)
		_ = cmd.Run()
		for _, pid := range []string{"supervisor.pid", "shim.pid"} { // in case uninstall could not
			if b, err := os.ReadFile(filepath.Join(prefix, "var/lib/tandem", pid)); err == nil {
				_ = testenv.KillPid(strings.TrimSpace(string(b)))
			}
		}
	})

	out, errs := install(bins.Shim)
	if !strings.Contains(out, "dstack-shim 0.21.3") || !strings.Contains(out, "supervisor script") || !strings.Contains(errs, "updated") {
		t.Fatalf("first install:\n%s\n%s", out, errs)
	}
	for _, f := range []string{"usr/local/bin/dstack-shim", "usr/local/bin/dstack-runner", "etc/dstack/shim.env", "usr/local/lib/tandem/supervise-shim.sh"} {
		if _, err := os.Stat(filepath.Join(prefix, f)); err != nil {
			t.Fatalf("install did not write %s: %v", f, err)
		}
	}
	env, _ := os.ReadFile(filepath.Join(prefix, "etc/dstack/shim.env"))
	if fi, _ := os.Stat(filepath.Join(prefix, "etc/dstack/shim.env")); fi.Mode().Perm() != 0o600 || !strings.Contains(string(env), `DSTACK_SHIM_HTTP_PORT="`+shimPort+`"`) {
		t.Fatalf("env file (%v):\n%s", fi.Mode(), env)
	}
	shim := "127.0.0.1:" + shimPort
	run, rout, rerr := tandemIn(t, dir, nil, append(append([]string{"run", "--rm"}, target...), "--shim", shim, "--image", img, "--", "/bin/sh", "-c", "echo through-the-installed-shim")...)
	if err := run.Run(); err != nil || !strings.Contains(rout.String(), "through-the-installed-shim") {
		t.Fatalf("run through the installed shim: %v\n%s\n%s", err, rout, rerr)
	}

	// Same binaries again: nothing changes, nothing restarts.
	c, _ := shimclient.New(shim)
	pidBefore, _ := os.ReadFile(filepath.Join(prefix, "var/lib/tandem/shim.pid"))
	_, errs = install(bins.Shim)
	pidAfter, _ := os.ReadFile(filepath.Join(prefix, "var/lib/tandem/shim.pid"))
	if !strings.Contains(errs, "nothing changed") || strings.Contains(errs, "restarted") || string(pidBefore) != string(pidAfter) {
		t.Fatalf("second install: %s (pid %s -> %s)", errs, pidBefore, pidAfter)
	}

	// An upgrade while a task runs: the shim restarts with the new binary,
	// the task and its container carry on.
	run, rout, rerr = tandemIn(t, dir, nil, append(append([]string{"run", "-d"}, target...), "--shim", shim, "--image", img, "--name", "keeps-running", "--", "sleep", "300")...)
	if err := run.Run(); err != nil {
		t.Fatalf("run -d: %v %s %s", err, rout, rerr)
	}
	taskID := strings.Fields(rout.String())[1]
	before, err := c.GetTask(context.Background(), taskID)
	if err != nil {
		t.Fatal(err)
	}
	upgraded := filepath.Join(t.TempDir(), "dstack-shim")
	copyFile(t, bins.Shim, upgraded)
	f, _ := os.OpenFile(upgraded, os.O_APPEND|os.O_WRONLY, 0)
	_, _ = f.WriteString("\x00tandem-upgrade-marker")
	f.Close()
	_, errs = install(upgraded)
	if !strings.Contains(errs, "usr/local/bin/dstack-shim") || !strings.Contains(errs, "shim restarted (tasks kept)") {
		t.Fatalf("upgrade: %s", errs)
	}
	if b, _ := os.ReadFile(filepath.Join(prefix, "usr/local/bin/dstack-shim")); !strings.HasSuffix(string(b), "tandem-upgrade-marker") {
		t.Fatal("the upgraded binary is not installed")
	}
	after, err := c.GetTask(context.Background(), taskID)
	if err != nil || after.Status != api.TaskRunning || after.ContainerID != before.ContainerID {
		t.Fatalf("task after the upgrade: %+v %v (before %+v)", after, err, before)
	}
	if state, _ := testenv.Docker(context.Background(), "inspect", "-f", "{{.State.Running}}", before.ContainerID); strings.TrimSpace(state) != "true" {
		t.Fatalf("the task's container stopped during the upgrade: %s", state)
	}

	// Uninstall refuses while the task lives; then removes everything but
	// the shim's home.
	cmd, _, errb := tandemIn(t, dir, nil, append([]string{"host", "uninstall"}, hostArgs...)...)
	if err := cmd.Run(); exitCodeOf(err) != 125 || !strings.Contains(errb.String(), "stop them first") {
		t.Fatalf("uninstall with a task: %v %s", err, errb)
	}
	rm, _, rmErr := tandemIn(t, dir, nil, append(append([]string{"rm", "-f"}, target...), "--shim", shim, "keeps-running")...)
	if err := rm.Run(); err != nil {
		t.Fatalf("rm: %v %s", err, rmErr)
	}
	cmd, out2, errb := tandemIn(t, dir, nil, append([]string{"host", "uninstall"}, hostArgs...)...)
	if err := cmd.Run(); err != nil {
		t.Fatalf("uninstall: %v %s %s", err, out2, errb)
	}
	for _, f := range []string{"usr/local/bin/dstack-shim", "usr/local/bin/dstack-runner", "etc/dstack/shim.env", "var/lib/tandem"} {
		if _, err := os.Stat(filepath.Join(prefix, f)); err == nil {
			t.Fatalf("uninstall left %s", f)
		}
	}
	if _, err := os.Stat(filepath.Join(prefix, "root/.dstack")); err != nil {
		t.Fatalf("uninstall removed the shim's home: %v", err)
	}
	hctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if _, err := c.Healthcheck(hctx); err == nil {
		t.Fatal("the shim still answers after uninstall")
	}
}
