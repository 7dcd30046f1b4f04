package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
)

// TestTandemFinishedTasks (issue 27): a job's end outlives its runner. rm
// works right after attach returned (no --force, no wait for the runner);
// once the runner and its container are gone, ps -a shows "exited (N)" with
// its age and the EXIT column, STATUS never goes back to running, and
// attach prints the kept output and exits with the job's status.
func TestTandemFinishedTasks(t *testing.T) {
	h, shim, _ := realStack(t)
	dir := t.TempDir()
	run := func(args ...string) (string, string, int) {
		cmd, out, errb := tandemIn(t, dir, nil, append(args[:1:1], append([]string{"--shim", shim}, args[1:]...)...)...)
		err := cmd.Run()
		return out.String(), errb.String(), exitCodeOf(err)
	}
	// 1: rm right after attach.
	if _, errOut, code := run("run", "-d", "--image", h.image, "--name", "fin-a", "--", "/bin/sh", "-c", "echo out-a; exit 3"); code != 0 {
		t.Fatalf("run -d: %d %s", code, errOut)
	}
	// stdout is a pipe: lines end in "\n", as dstack logs prints them.
	if out, errOut, code := run("attach", "fin-a"); code != 3 || !strings.Contains(out, "out-a\n") || strings.Contains(out, "\r") {
		t.Fatalf("attach: %d %q %s", code, out, errOut)
	}
	if _, errOut, code := run("rm", "fin-a"); code != 0 {
		t.Fatalf("rm right after attach: %d %s", code, errOut)
	}

	// 2: the runner and its container end; the status stays.
	if _, errOut, code := run("run", "-d", "--image", h.image, "--name", "fin-b", "--", "/bin/sh", "-c", "echo out-b; exit 5"); code != 0 {
		t.Fatalf("run -d: %d %s", code, errOut)
	}
	if _, _, code := run("attach", "fin-b"); code != 5 { // collects the logs: the runner leaves after its linger
		t.Fatalf("first attach: %d", code)
	}
	var info api.TaskInfoResponse
	deadline := time.Now().Add(90 * time.Second)
	var statuses []string
	for {
		out, _, _ := run("ps", "-a")
		for _, l := range strings.Split(out, "\n") {
			if strings.HasPrefix(l, "fin-b ") {
				statuses = append(statuses, l)
				if strings.Contains(l, " running ") || strings.Contains(l, "job running") {
					t.Fatalf("STATUS went back from the end: %q (before: %q)", l, statuses)
				}
			}
		}
		items, _ := h.client.ListTasks(context.Background())
		for _, it := range items {
			if i, err := h.client.GetTask(context.Background(), it.ID); err == nil && i.Tandem != nil && i.Tandem.Name == "fin-b" {
				info = i
			}
		}
		if info.Status == api.TaskTerminated {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the runner never left: %+v", info)
		}
		time.Sleep(time.Second)
	}
	out, _, _ := run("ps", "-a")
	var line string
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, "fin-b ") {
			line = l
		}
	}
	f := strings.Fields(line)
	if !strings.Contains(line, "exited (5)") || !strings.Contains(line, " ago") || len(f) == 0 || f[len(f)-1] != "5" {
		t.Fatalf("ps -a after the runner left: %q", line)
	}
	if out, errOut, code := run("attach", "fin-b"); code != 5 || !strings.Contains(out, "out-b") {
		t.Fatalf("attach on a finished task: %d %q %s", code, out, errOut)
	}
	if out, _, code := run("logs", "fin-b"); code != 0 || !strings.Contains(out, "out-b") {
		t.Fatalf("logs of a finished task: %d %q", code, out)
	}
	if _, errOut, code := run("rm", "fin-b"); code != 0 {
		t.Fatalf("rm: %d %s", code, errOut)
	}
}
