package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/e2e/testenv"
	"github.com/tandem-run/tandem/shim/task"
)

// TestForkBombStaysInItsTask (issue 39): every task's container has a pids
// limit. A fork bomb in one task runs into it while a second task on the
// same shim forks 50 children and finishes, and the shim answers. On the
// build before the fix the container had no limit (PidsLimit null) and a
// bomb could take the host's whole pid pool.
func TestForkBombStaysInItsTask(t *testing.T) {
	testenv.RequireDocker(t)
	const limit = 256
	// The bomb forks until its container's limit (its shell then dies; its
	// children hold the pids), while the container lives on.
	body := `case "$TANDEM_TASK_ID" in
bomb-*) (while true; do sleep 300 & done) 2>/dev/null & exec sleep 3600 ;;
*) i=0; while [ $i -lt 50 ]; do sleep 1 & i=$((i+1)); done; wait; echo forked-and-waited > /tmp/runner/ok; exec sleep 300 ;;
esac`
	h := startShim(t, runnerScript(t, body), nil, "--pids-limit", strconv.Itoa(limit))
	bomb := h.submit(api.TaskConfig{ID: randomID("bomb"), NetworkMode: "host"})
	h.wait(bomb.ID, time.Minute, running)
	ctx := context.Background()
	name := task.ContainerName(bomb.Name, bomb.ID)
	if got, err := testenv.Docker(ctx, "inspect", "-f", "{{.HostConfig.PidsLimit}}", name); err != nil || strings.TrimSpace(got) != strconv.Itoa(limit) {
		t.Fatalf("the bomb's container pids limit: %q %v", got, err)
	}
	// The bomb reaches its limit.
	deadline := time.Now().Add(30 * time.Second)
	for {
		out, _ := testenv.Docker(ctx, "stats", "--no-stream", "--format", "{{.PIDs}}", name)
		if n, err := strconv.Atoi(strings.TrimSpace(out)); err == nil && n >= limit-5 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the bomb did not reach its limit: %q", out)
		}
		time.Sleep(200 * time.Millisecond)
	}
	// Meanwhile the shim answers and another task forks and finishes.
	t0 := time.Now()
	if _, err := h.client.Healthcheck(ctx); err != nil || time.Since(t0) > 5*time.Second {
		t.Fatalf("the shim under the bomb: %v after %s", err, time.Since(t0))
	}
	other := h.submit(api.TaskConfig{ID: randomID("calm"), NetworkMode: "host"})
	h.wait(other.ID, time.Minute, running)
	okFile := filepath.Join(h.home, "runners", task.ContainerName(other.Name, other.ID), "ok")
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if b, err := os.ReadFile(okFile); err == nil && strings.TrimSpace(string(b)) == "forked-and-waited" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the second task could not fork while the bomb ran")
		}
	}
	h.terminate(bomb.ID, api.ReasonTerminatedByUser, "", 0)
	h.terminate(other.ID, api.ReasonTerminatedByUser, "", 0)
}
