package e2e

import (
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tandem-run/tandem/ctl"
)

// TestTandemWait: `tandem wait` blocks until each named job ends and
// prints the code `tandem run` would have exited with, in the order
// given: a job's own status, 0, and 143 for a job someone stopped; the
// ended task's code is still there after its runner left; a name that
// matches nothing is refused; Ctrl-C leaves the job running (and so does
// attach's).
func TestTandemWait(t *testing.T) {
	h, shim, _ := realStack(t)
	dir := t.TempDir()
	for _, args := range [][]string{
		{"--name", "three", "--", "/bin/sh", "-c", "sleep 2; exit 3"},
		{"--name", "ok", "--", "true"},
		{"--name", "long", "--", "sleep", "600"},
	} {
		run, out, errb := tandemIn(t, dir, nil, append([]string{"run", "-d", "--shim", shim, "--image", h.image, "--network", "bridge"}, args...)...)
		if err := run.Run(); err != nil {
			t.Fatalf("run -d %v: %v %s %s", args, err, out, errb)
		}
	}
	start := time.Now()
	cmd, out, errb := tandemIn(t, dir, nil, "wait", "--shim", shim, "three", "ok")
	if err := cmd.Run(); err != nil {
		t.Fatalf("wait: %v %s", err, errb)
	}
	if got := strings.Fields(out.String()); strings.Join(got, " ") != "3 0" {
		t.Fatalf("wait three ok: %q, want 3 then 0", out)
	}
	if took := time.Since(start); took > 15*time.Second {
		t.Fatalf("wait took %s for a 2 s job", took)
	}
	// Again, once the shim kept the end: the same code.
	cmd, out, errb = tandemIn(t, dir, nil, "wait", "--shim", shim, "three")
	if err := cmd.Run(); err != nil || strings.TrimSpace(out.String()) != "3" {
		t.Fatalf("wait three again: %v %q %s", err, out, errb)
	}
	cmd, out, errb = tandemIn(t, dir, nil, "wait", "--shim", shim, "nosuch")
	if err := cmd.Run(); exitCodeOf(err) != ctl.ExitFailure || !strings.Contains(errb.String(), "no such task") {
		t.Fatalf("wait nosuch: exit %d, %q %q", exitCodeOf(err), out, errb)
	}

	// Ctrl-C: the wait ends, the job runs on.
	cmd, _, errb = tandemIn(t, dir, nil, "wait", "--shim", shim, "long")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	_ = cmd.Process.Signal(syscall.SIGINT)
	if err := cmd.Wait(); exitCodeOf(err) != ctl.ExitInterrupted {
		t.Fatalf("wait after Ctrl-C: exit %d %q", exitCodeOf(err), errb)
	}
	ps, psOut, psErr := tandemIn(t, dir, nil, "ps", "--shim", shim)
	if err := ps.Run(); err != nil || !strings.Contains(psOut.String(), "long") {
		t.Fatalf("ps after the interrupted wait: %v %q %s", err, psOut, psErr)
	}

	// attach's Ctrl-C detaches the same way.
	cmd, _, errb = tandemIn(t, dir, nil, "attach", "--shim", shim, "long")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	_ = cmd.Process.Signal(syscall.SIGINT)
	if err := cmd.Wait(); exitCodeOf(err) != ctl.ExitInterrupted || !strings.Contains(errb.String(), "detached; the job runs on") {
		t.Fatalf("attach after Ctrl-C: exit %d %q", exitCodeOf(err), errb)
	}
	ps, psOut, psErr = tandemIn(t, dir, nil, "ps", "--shim", shim)
	if err := ps.Run(); err != nil || !strings.Contains(psOut.String(), "long") {
		t.Fatalf("ps after the detached attach: %v %q %s", err, psOut, psErr)
	}

	// A job someone stops: the waiter sees 143.
	cmd, out, errb = tandemIn(t, dir, nil, "wait", "--shim", shim, "long")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	stop, sOut, sErr := tandemIn(t, dir, nil, "stop", "--shim", shim, "long")
	if err := stop.Run(); err != nil {
		t.Fatalf("stop: %v %s %s", err, sOut, sErr)
	}
	if err := cmd.Wait(); err != nil || strings.TrimSpace(out.String()) != "143" {
		t.Fatalf("wait on a stopped job: %v %q %q", err, out, errb)
	}
}
