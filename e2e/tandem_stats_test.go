package e2e

import (
	"bufio"
	"encoding/json"
	"io"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tandem-run/tandem/ctl"
)

// TestTandemStats: `tandem stats` reads each running task's use from its
// runner, as docker stats does: a job spinning on a core shows CPU use
// against an idle one beside it, both with their memory, the limits they
// were submitted with; one task by name, a name that matches nothing
// refused; the stream prints a table per interval until Ctrl-C, which
// ends it with 0.
func TestTandemStats(t *testing.T) {
	h, shim, _ := realStack(t)
	dir := t.TempDir()
	for _, args := range [][]string{
		{"--name", "spin", "--cpu", "1", "--memory", "256MiB", "--", "/bin/sh", "-c", "while :; do :; done"},
		{"--name", "idle", "--", "sleep", "600"},
	} {
		run, out, errb := tandemIn(t, dir, nil, append([]string{"run", "-d", "--shim", shim, "--image", h.image, "--network", "bridge"}, args...)...)
		if err := run.Run(); err != nil {
			t.Fatalf("run -d %v: %v %s %s", args, err, out, errb)
		}
	}

	cmd, out, errb := tandemIn(t, dir, nil, "stats", "--shim", shim, "--no-stream", "--interval", "1s", "-o", "json")
	if err := cmd.Run(); err != nil {
		t.Fatalf("stats: %v %s", err, errb)
	}
	var stats []ctl.Stat
	if err := json.Unmarshal(out.Bytes(), &stats); err != nil {
		t.Fatalf("stats -o json: %v\n%s", err, out)
	}
	byName := map[string]ctl.Stat{}
	for _, s := range stats {
		byName[s.Name] = s
	}
	spin, idle := byName["spin"], byName["idle"]
	if len(stats) != 2 || spin.ID == "" || idle.ID == "" {
		t.Fatalf("stats rows: %+v", stats)
	}
	for _, s := range stats {
		if s.Error != "" || s.CPUPercent == nil || s.MemoryBytes == 0 {
			t.Fatalf("%s: no figures: %+v", s.Name, s)
		}
	}
	// One core spinning (the machine's other work shares two cores); the
	// sleeping job next to nothing.
	if *spin.CPUPercent < 30 || *spin.CPUPercent > 110 || *idle.CPUPercent > 10 {
		t.Fatalf("CPU use: spin %.1f%%, idle %.1f%%", *spin.CPUPercent, *idle.CPUPercent)
	}
	if spin.CPULimit != 1 || spin.MemoryLimit != 256<<20 || idle.CPULimit != 0 || idle.MemoryLimit != 0 {
		t.Fatalf("limits: spin %v/%d, idle %v/%d", spin.CPULimit, spin.MemoryLimit, idle.CPULimit, idle.MemoryLimit)
	}
	t.Logf("spin %.1f%% CPU, %d bytes; idle %.1f%%, %d bytes", *spin.CPUPercent, spin.MemoryBytes, *idle.CPUPercent, idle.MemoryBytes)

	// One task, by name, as a table.
	cmd, out, errb = tandemIn(t, dir, nil, "stats", "--shim", shim, "--no-stream", "--interval", "200ms", "spin")
	if err := cmd.Run(); err != nil {
		t.Fatalf("stats spin: %v %s", err, errb)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 2 || !strings.HasPrefix(lines[0], "NAME") || !strings.HasPrefix(lines[1], "spin ") ||
		!strings.Contains(lines[1], " / 256MiB") || !strings.Contains(lines[1], "%") {
		t.Fatalf("stats spin:\n%s", out)
	}
	t.Logf("stats spin:\n%s", out)
	cmd, out, errb = tandemIn(t, dir, nil, "stats", "--shim", shim, "--no-stream", "nosuch")
	if err := cmd.Run(); exitCodeOf(err) != ctl.ExitFailure || !strings.Contains(errb.String(), "no such task") {
		t.Fatalf("stats nosuch: exit %d, %q %q", exitCodeOf(err), out, errb)
	}
	cmd, _, errb = tandemIn(t, dir, nil, "stats", "--shim", shim, "--interval", "1ms")
	if err := cmd.Run(); exitCodeOf(err) != ctl.ExitFailure || !strings.Contains(errb.String(), "--interval") {
		t.Fatalf("stats --interval 1ms: exit %d, %q", exitCodeOf(err), errb)
	}

	// The stream: a JSON array per interval, until Ctrl-C.
	cmd, _, errb = tandemIn(t, dir, nil, "stats", "--shim", shim, "--interval", "300ms", "-o", "json", "idle")
	pr, pw := io.Pipe()
	cmd.Stdout = pw
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill() }()
	got := make(chan int, 1)
	go func() {
		dec := json.NewDecoder(bufio.NewReader(pr))
		n := 0
		for n < 3 {
			var s []ctl.Stat
			if err := dec.Decode(&s); err != nil || len(s) != 1 || s[0].Name != "idle" {
				break
			}
			n++
		}
		got <- n
		_, _ = io.Copy(io.Discard, pr)
	}()
	select {
	case n := <-got:
		if n != 3 {
			t.Fatalf("stream: %d good tables before it broke; stderr %q", n, errb)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("stream: no three tables in 20 s; stderr %q", errb)
	}
	_ = cmd.Process.Signal(syscall.SIGINT)
	err := cmd.Wait()
	pw.Close()
	if code := exitCodeOf(err); code != 0 {
		t.Fatalf("stream after Ctrl-C: exit %d (%v) %q", code, err, errb)
	}
}
