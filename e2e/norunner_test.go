package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
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

	cmd, out, errb = tandem(t, "run", "--shim", shim, "--no-ssh-config", h.image, "true")
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
