package e2e

import (
	"strings"
	"testing"
)

// psRowOf is the ps -a line of the task named name ("" when none).
func psRowOf(run func(args ...string) (string, string, int), name string) string {
	out, _, _ := run("ps", "-a")
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, name+" ") {
			return l
		}
	}
	return ""
}

// TestTandemStopKeepsTask (issue 67, items 3 and 8): stop stops a task
// and keeps it, as docker stop: its output, its exit status and its ps -a
// row stay until rm; rm of a running task says to stop it or add -f; rm
// -f stops and removes; a finished foreground run stays in ps -a until
// pruned, unless --rm; logs right after run -d shows what the job printed.
func TestTandemStopKeepsTask(t *testing.T) {
	h, shim, _ := realStack(t)
	run := tandemAt(t, t.TempDir(), shim)
	if out, errOut, code := run("run", "-d", "--no-ssh-config", "--name", "keep-a", h.image, "sh", "-c", "echo early-line; exec sleep 300"); code != 0 {
		t.Fatalf("run -d: %d %s %s", code, out, errOut)
	}
	// Right after run -d: the job's first line, not an empty answer.
	if out, errOut, code := run("logs", "keep-a"); code != 0 || !strings.Contains(out, "early-line") {
		t.Fatalf("logs right after run -d: %d %q %q", code, out, errOut)
	}
	_, errOut, code := run("rm", "keep-a")
	if want := "tandem: task keep-a is running: stop it first (tandem stop), or add -f to stop and remove it (tandem rm -f)\n"; code != 125 || errOut != want {
		t.Fatalf("rm of a running task: %d %q, want %q", code, errOut, want)
	}
	if out, errOut, code := run("stop", "-t", "1", "keep-a"); code != 0 || !strings.HasPrefix(out, "stopped\tkeep-a\t") {
		t.Fatalf("stop: %d %q %q", code, out, errOut)
	}
	if row := psRowOf(run, "keep-a"); row == "" {
		t.Fatal("ps -a after stop: no keep-a row")
	}
	if out, errOut, code := run("logs", "keep-a"); code != 0 || !strings.Contains(out, "early-line") {
		t.Fatalf("logs after stop: %d %q %q", code, out, errOut)
	}
	if out, errOut, code := run("rm", "keep-a"); code != 0 || !strings.HasPrefix(out, "removed\tkeep-a\t") {
		t.Fatalf("rm of a stopped task: %d %q %q", code, out, errOut)
	}
	if row := psRowOf(run, "keep-a"); row != "" {
		t.Fatalf("ps -a after rm: %q", row)
	}

	// rm -f: stopped at once, then removed.
	if _, errOut, code := run("run", "-d", "--no-ssh-config", "--name", "keep-b", h.image, "sleep", "300"); code != 0 {
		t.Fatalf("run -d: %d %s", code, errOut)
	}
	if out, errOut, code := run("rm", "-f", "keep-b"); code != 0 || !strings.HasPrefix(out, "removed\tkeep-b\t") {
		t.Fatalf("rm -f: %d %q %q", code, out, errOut)
	}

	// A finished foreground run is kept, with its exit status and output.
	if out, errOut, code := run("run", "--no-ssh-config", "--name", "fg", h.image, "sh", "-c", "echo fg-out; exit 4"); code != 4 || !strings.Contains(out, "fg-out") {
		t.Fatalf("run: %d %q %q", code, out, errOut)
	}
	if row := psRowOf(run, "fg"); !strings.Contains(row, " 4") {
		t.Fatalf("ps -a of a finished run: %q", row)
	}
	if out, errOut, code := run("logs", "fg"); code != 0 || !strings.Contains(out, "fg-out") {
		t.Fatalf("logs of a finished run: %d %q %q", code, out, errOut)
	}
	// --rm: gone at the end.
	if _, errOut, code := run("run", "--rm", "--no-ssh-config", "--name", "fg-rm", h.image, "true"); code != 0 {
		t.Fatalf("run --rm: %d %q", code, errOut)
	}
	if row := psRowOf(run, "fg-rm"); row != "" {
		t.Fatalf("ps -a after run --rm: %q", row)
	}
	if out, errOut, code := run("prune"); code != 0 || !strings.Contains(out, "removed\tfg\t") {
		t.Fatalf("prune: %d %q %q", code, out, errOut)
	}
	if row := psRowOf(run, "fg"); row != "" {
		t.Fatalf("ps -a after prune: %q", row)
	}
}
