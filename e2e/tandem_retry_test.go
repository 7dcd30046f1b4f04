package e2e

import (
	"bufio"
	"context"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestTandemRunSurvivesAFrozenShim (issue 27): the shim is frozen with
// SIGSTOP for 12 s while `tandem run` runs its job (longer than one call's
// 9 s timeout); the job ends meanwhile. tandem retries its calls, finishes
// with the job's status once the shim is back, and leaves no task behind.
func TestTandemRunSurvivesAFrozenShim(t *testing.T) {
	h, shim, rport := realStack(t)
	pid := h.cmd.Process.Pid
	t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGCONT) })
	freeze := func() {
		_ = syscall.Kill(pid, syscall.SIGSTOP)
		go func() {
			time.Sleep(12 * time.Second)
			_ = syscall.Kill(pid, syscall.SIGCONT)
		}()
	}

	// 1: frozen as soon as the task is submitted, while tandem waits for it
	// to run (one failed call ended the run before).
	cmd, out1, errb1 := tandem(t, "run", "--rm", "--shim", shim, "--runner-port", rport, "--image", h.image, "--", "/bin/sh", "-c", "echo ran-after-freeze")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		items, _ := h.client.ListTasks(context.Background())
		if len(items) > 0 {
			freeze()
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the task never appeared")
		}
		time.Sleep(2 * time.Millisecond)
	}
	if err := cmd.Wait(); err != nil || !strings.Contains(out1.String(), "ran-after-freeze") {
		t.Fatalf("run with the shim frozen after the submit: %v\n%s\n%s", err, out1, errb1)
	}
	time.Sleep(time.Second)

	// 2: frozen while the job runs; the job ends meanwhile, and tandem's
	// cleanup waits for the shim.
	cmd, _, errb := tandem(t, "run", "--rm", "--shim", shim, "--runner-port", rport, "--image", h.image, "--",
		"/bin/sh", "-c", "echo started; sleep 3; echo finished; exit 3")
	var err error
	cmd.Stdout = nil
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	var stdout strings.Builder
	go func() {
		sc := bufio.NewScanner(out)
		froze := false
		for sc.Scan() {
			stdout.WriteString(sc.Text() + "\n")
			if !froze && strings.Contains(sc.Text(), "started") {
				froze = true
				freeze()
			}
		}
		done <- cmd.Wait()
	}()
	select {
	case err = <-done:
	case <-time.After(3 * time.Minute):
		_ = cmd.Process.Kill()
		t.Fatalf("tandem never finished:\n%s", errb)
	}
	if exitCodeOf(err) != 3 || !strings.Contains(stdout.String(), "finished") {
		t.Fatalf("run across a frozen shim: exit %d\n%s\n%s", exitCodeOf(err), stdout.String(), errb)
	}
	if strings.Contains(errb.String(), "left on the shim") {
		t.Fatalf("cleanup gave up: %s", errb)
	}
	items, err := h.client.ListTasks(context.Background())
	if err != nil || len(items) != 0 {
		t.Fatalf("tasks left: %+v %v\n%s", items, err, errb)
	}
}
