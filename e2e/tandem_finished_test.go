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
	run := tandemAt(t, t.TempDir(), shim)
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

// A task the server terminates with no grace (timeout 0: docker kills the
// container at once) right after its job printed keeps that output: the
// runner writes it to disk when the stop reaches it, not on its 250 ms
// timer. logs, logs -f and attach then print it, and attach ends as
// tandem wait says (143: someone stopped it); logs --since says the kept
// output has no times; a running task's logs --since reads its runner.
func TestTandemTerminatedTaskKeepsItsLastOutput(t *testing.T) {
	h, shim, _ := realStack(t)
	run := tandemAt(t, t.TempDir(), shim)
	out, errOut, code := run("run", "-d", "--image", h.image, "--name", "term-a", "--", "/bin/sh", "-c", "echo last-words; exec sleep 600")
	if code != 0 {
		t.Fatalf("run -d: %d %s", code, errOut)
	}
	id := strings.Fields(out)[1]
	// The job has printed once logs --since (its runner's times) shows it.
	deadline := time.Now().Add(30 * time.Second)
	for {
		got, errOut, code := run("logs", "--since", "1m", "term-a")
		if code != 0 {
			t.Fatalf("logs --since of a running task: %d %s", code, errOut)
		}
		if strings.Contains(got, "last-words") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("logs --since never showed the output: %q", got)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, err := h.client.TerminateTask(context.Background(), id, api.TaskTerminateRequest{
		TerminationReason: api.ReasonTerminatedByServer, TerminationMessage: "no grace", Timeout: 0}); err != nil {
		t.Fatal(err)
	}
	if got, errOut, code := run("logs", "term-a"); code != 0 || got != "last-words\n" {
		t.Fatalf("logs after a kill: %d %q %s", code, got, errOut)
	}
	if got, errOut, code := run("logs", "-f", "term-a"); code != 0 || got != "last-words\n" {
		t.Fatalf("logs -f of a terminated task: %d %q %s", code, got, errOut)
	}
	if got, errOut, code := run("attach", "term-a"); code != 143 || got != "last-words\n" {
		t.Fatalf("attach of a terminated task: %d %q %s", code, got, errOut)
	}
	if got, errOut, code := run("logs", "--since", "1m", "term-a"); code != 125 || got != "" || !strings.Contains(errOut, "drop --since") {
		t.Fatalf("logs --since of a terminated task: %d %q %s", code, got, errOut)
	}
	if _, errOut, code := run("rm", "term-a"); code != 0 {
		t.Fatalf("rm: %d %s", code, errOut)
	}
}

// tandemAt returns a runner of tandem commands (the command, then its
// flags and arguments) against shim, in dir: stdout, stderr, exit code.
func tandemAt(t *testing.T, dir, shim string) func(args ...string) (string, string, int) {
	return func(args ...string) (string, string, int) {
		return outcome(tandemIn(t, dir, nil, append(args[:1:1], append([]string{"--shim", shim}, args[1:]...)...)...))
	}
}

// TestTandemRunWithoutContainerLeavesNothing: a run whose task never got a
// container (its image does not pull) is removed even without --rm, as
// docker run leaves nothing when its create fails: it says why, ps -a has
// no row for it, the shim holds no task of that name, and the name is free
// for the next run. A run that got its container is kept
// (TestTandemFinishedTasks).
func TestTandemRunWithoutContainerLeavesNothing(t *testing.T) {
	h, shim, _ := realStack(t)
	run := tandemAt(t, t.TempDir(), shim)
	_, errOut, code := run("run", "--name", "never-ran", "--image", "no-such-image:v1", "--", "true")
	if code != 125 || !strings.Contains(errOut, "pullImage error") {
		t.Fatalf("run of an image that does not pull: %d %s", code, errOut)
	}
	if out, _, _ := run("ps", "-a"); strings.Contains(out, "never-ran") {
		t.Fatalf("ps -a shows the run that never got a container:\n%s", out)
	}
	items, err := h.client.ListTasks(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, it := range items {
		if i, err := h.client.GetTask(context.Background(), it.ID); err == nil && i.Tandem != nil && i.Tandem.Name == "never-ran" {
			t.Fatalf("the shim still holds the task: %+v", i)
		}
	}
	if out, errOut, code := run("run", "--rm", "--name", "never-ran", "--image", h.image, "--", "echo", "second"); code != 0 || !strings.Contains(out, "second") {
		t.Fatalf("the name was not free again: %d %q %s", code, out, errOut)
	}
}
