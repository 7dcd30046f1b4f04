package e2e

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/e2e/testenv"
)

// TestShimWithoutRunnerSaysSo: a shim started without a runner binary
// (no --runner-binary-path, none installed) says so where each reader
// looks, with the fix: its log at the start, its instance health (a
// failure, the dstack server's word for a host no task can start on) and
// so `tandem info`; `tandem run` is refused before any task is made. Its
// health had answered ok, and a run failed on Docker's bind error.
func TestShimWithoutRunnerSaysSo(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "dstack-runner")
	h := startShim(t, missing, nil)
	shim := strings.TrimPrefix(h.client.BaseURL(), "http://")

	cmd, out, errb := tandem(t, "info", "--shim", shim)
	if err := cmd.Run(); err != nil {
		t.Fatalf("tandem info: %v\n%s", err, errb)
	}
	want := "health:    failure: no dstack-runner at " + missing + ", so no task can start: start dstack-shim with --runner-binary-path PATH (a build's bin/dstack-runner), or install one (POST /api/components/install)\n"
	if !strings.Contains(out.String(), want) || !strings.Contains(out.String(), "component: dstack-runner  (not-installed)") {
		t.Fatalf("tandem info does not say the runner is missing:\n%s\nwant the line %q", out, want)
	}

	cmd, _, errb = tandem(t, "run", "--shim", shim, "--no-ssh-config", h.image, "true")
	err := cmd.Run()
	if want := "tandem: the shim at " + shim + " has no dstack-runner, so no task can start there: start dstack-shim with --runner-binary-path PATH (a build's bin/dstack-runner; make shim does)\n"; exitCodeOf(err) != 125 || !strings.HasSuffix(errb.String(), want) {
		t.Fatalf("tandem run: exit %d, %q\nwant a stderr ending %q", exitCodeOf(err), errb, want)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if tasks, err := h.client.ListTasks(ctx); err != nil || len(tasks) != 0 {
		t.Fatalf("a task was made: %+v %v", tasks, err)
	}

	log, err := os.ReadFile(filepath.Join(h.home, "shim.log"))
	if err != nil || !strings.Contains(string(log), `msg="no runner binary: every task fails until there is one; start the shim with --runner-binary-path PATH`) {
		t.Fatalf("the shim's log does not warn at its start: %v\n%s", err, log)
	}
}

// TestShimTakesARelativeRunnerPath: `dstack-shim --runner-binary-path
// bin/dstack-runner`, as one types it in a checkout (make shim), runs
// jobs: the path is its directory's, where Docker's bind takes only an
// absolute one (every task had failed on it).
func TestShimTakesARelativeRunnerPath(t *testing.T) {
	bins := testenv.Binaries(t)
	dir := t.TempDir()
	b, err := os.ReadFile(bins.Runner)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(dir, "bin"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "bin", "dstack-runner"), b, 0o755); err != nil {
		t.Fatal(err)
	}
	home := t.TempDir()
	testenv.UnmountUnder(t, home)
	_, port, _ := net.SplitHostPort(testenv.FreeAddr(t))
	_, rport, _ := net.SplitHostPort(testenv.FreeAddr(t))
	_, sshPort, _ := net.SplitHostPort(testenv.FreeAddr(t))
	cmd := exec.Command(bins.Shim, "--shim-home", home, "--shim-http-port", port, "--runner-http-port", rport, "--runner-ssh-port", sshPort,
		"--runner-binary-path", "bin/dstack-runner")
	cmd.Dir = dir
	testenv.StartDaemon(t, cmd)
	shim := "127.0.0.1:" + port
	deadline := time.Now().Add(10 * time.Second)
	for {
		info, _, _ := tandem(t, "info", "--shim", shim)
		if info.Run() == nil {
			break
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(filepath.Join(home, "shim.log"))
			t.Fatalf("the shim did not serve:\n%s", log)
		}
		time.Sleep(50 * time.Millisecond)
	}
	run, out, errb := tandem(t, "run", "--rm", "--shim", shim, "--runner-port", rport, "--no-ssh-config", testenv.Busybox(t), "echo", "ran")
	if err := run.Run(); err != nil || out.String() != "ran\n" {
		log, _ := os.ReadFile(filepath.Join(home, "shim.log"))
		t.Fatalf("a job on a shim given a relative runner path: %v %q\n%s\nshim log:\n%s", err, out, errb, tailStr(string(log), 2000))
	}
}
