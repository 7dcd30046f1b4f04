package executor

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
)

// runJob runs commands as a job in a fresh executor and returns its final
// state event.
func runJob(t *testing.T, cfg Config, commands ...string) api.JobStateEvent {
	t.Helper()
	return runJobFile(t, cfg, true, commands...)
}

// runJobFile is runJob in cfg.TempDir when set; finalFile says whether the
// final state's file must be there as soon as the end is pullable.
func runJobFile(t *testing.T, cfg Config, finalFile bool, commands ...string) api.JobStateEvent {
	t.Helper()
	return runJobWith(t, cfg, nil, finalFile, commands...)
}

// runJobWith is runJobFile with a Tandem client's submit extras.
func runJobWith(t *testing.T, cfg Config, extras *api.SubmitExtras, finalFile bool, commands ...string) api.JobStateEvent {
	t.Helper()
	if cfg.TempDir == "" {
		cfg.TempDir = t.TempDir()
	}
	x, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { x.Close() })
	wd := t.TempDir()
	if err := x.Submit(api.SubmitBody{JobSpec: api.JobSpec{Commands: commands, WorkingDir: &wd, RepoDir: &wd}, Tandem: extras}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := x.Run(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		p, err := x.Pull(0)
		if err != nil {
			t.Fatal(err)
		}
		if n := len(p.JobStates); n > 0 && p.JobStates[n-1].State.Final() {
			// The shim's file has the end as soon as a reader does (a
			// client that saw it may remove the task at once).
			b, err := os.ReadFile(filepath.Join(cfg.TempDir, FinalFile))
			var left api.JobStateEvent
			if err == nil {
				err = json.Unmarshal(b, &left)
			}
			if finalFile && (err != nil || left.State != p.JobStates[n-1].State || left.Timestamp != p.JobStates[n-1].Timestamp) {
				t.Fatalf("the job's end is pullable but its file says %+v (%v)", left, err)
			}
			// The final state is pullable before the executor has
			// written everything into its temp dir: wait for that, or
			// the dir's removal races the last writes.
			select {
			case <-x.Finished():
			case <-time.After(time.Until(deadline)):
				t.Fatalf("job %q ended but its records were not finished", commands)
			}
			return p.JobStates[n-1]
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("job %q did not end", commands)
	return api.JobStateEvent{}
}

// TestExitStatusLikeAShell: the runner reports what a shell would: 127 for
// a command not found, 126 for one that cannot run, 128+N for a job killed
// by signal N, and an OOM kill (the cgroup's counter moved) says so.
func TestExitStatusLikeAShell(t *testing.T) {
	notExec := filepath.Join(t.TempDir(), "script")
	if err := os.WriteFile(notExec, []byte("#!/bin/sh\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cg := t.TempDir()
	events := filepath.Join(cg, "memory.events")
	if err := os.WriteFile(events, []byte("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name     string
		cmd      []string
		cgroup   string
		want     int
		state    api.JobState
		msgHas   string
		noReason bool
	}{
		{"exit 3", []string{"/bin/sh", "-c", "exit 3"}, "", 3, api.JobFailed, "", true},
		{"not found", []string{"no-such-command-here"}, "", 127, api.JobFailed, "not found", false},
		{"missing path", []string{"/no/such/file"}, "", 127, api.JobFailed, "no such file", false},
		{"not executable", []string{notExec}, "", 126, api.JobFailed, "permission denied", false},
		{"SIGTERM", []string{"/bin/sh", "-c", "kill -TERM $$"}, "", 143, api.JobFailed, "SIGTERM", true},
		{"SIGKILL, no OOM", []string{"/bin/sh", "-c", "kill -KILL $$"}, cg, 137, api.JobFailed, "SIGKILL", true},
		{"OOM", []string{"/bin/sh", "-c", "printf 'oom 1\\noom_kill 1\\n' > " + events + "; kill -KILL $$"}, cg, 137, api.JobFailed, "out of memory", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ev := runJob(t, Config{CgroupRoot: tc.cgroup}, tc.cmd...)
			if ev.State != tc.state || ev.ExitStatus == nil || *ev.ExitStatus != tc.want {
				t.Fatalf("state %s exit %v (%s: %s), want %s %d", ev.State, ev.ExitStatus, ev.TerminationReason, ev.TerminationMessage, tc.state, tc.want)
			}
			if !strings.Contains(strings.ToLower(ev.TerminationMessage), strings.ToLower(tc.msgHas)) {
				t.Fatalf("message %q, want it to say %q", ev.TerminationMessage, tc.msgHas)
			}
			if tc.noReason && ev.TerminationReason != "" {
				t.Fatalf("reason %q for a job that ran", ev.TerminationReason)
			}
		})
	}
	if n := oomKills(t.TempDir()); n != -1 {
		t.Fatalf("no counter read as %d", n)
	}
}

// TestPeekDoesNotCollect: an onlooker's pull (tandem ps) of a finished job
// leaves the runner waiting for the real collector; a pull ends the wait.
func TestPeekDoesNotCollect(t *testing.T) {
	x, err := New(Config{TempDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { x.Close() })
	wd := t.TempDir()
	if err := x.Submit(api.SubmitBody{JobSpec: api.JobSpec{Commands: []string{"/bin/sh", "-c", "echo hi"}, WorkingDir: &wd, RepoDir: &wd}}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := x.Run(); err != nil {
		t.Fatal(err)
	}
	<-x.Finished()
	for x.State() != WaitLogsFinished {
		time.Sleep(10 * time.Millisecond)
	}
	p, err := x.Peek(0)
	if err != nil || len(p.JobStates) == 0 || p.JobStates[len(p.JobStates)-1].State != api.JobDone {
		t.Fatalf("peek: %+v %v", p.JobStates, err)
	}
	select {
	case <-x.PullConsumed():
		t.Fatal("a peek counted as collecting the logs")
	case <-time.After(100 * time.Millisecond):
	}
	if _, err := x.Pull(0); err != nil {
		t.Fatal(err)
	}
	select {
	case <-x.PullConsumed():
	case <-time.After(time.Second):
		t.Fatal("a pull of everything did not count as collecting")
	}
}

// TestOutputCutKeepsAChunkInFlight: the reader took "cleaned\n" from the
// terminal just before the stop measured the cut (so it was neither
// accounted nor pending): its complete lines stay; the prompt after goes.
func TestOutputCutKeepsAChunkInFlight(t *testing.T) {
	var c outputCut
	var got []byte
	got = append(got, c.pass([]byte("ready\n"))...)
	c.stopping()
	got = append(got, c.pass([]byte("^Ccaught\n"))...)
	c.at(0) // measured while "cleaned\n" was in flight
	got = append(got, c.pass([]byte("cleaned\n/workflow # "))...)
	got = append(got, c.pass([]byte("more prompt\n"))...) // after the cut: dropped
	got = append(got, c.rest()...)
	if string(got) != "ready\n^Ccaught\ncleaned\n" {
		t.Fatalf("kept %q", got)
	}
	// Without a chunk in flight the cut holds where it was measured.
	var d outputCut
	got = append(d.pass([]byte("ready\n")), nil...)
	d.stopping()
	d.at(0)
	got = append(got, d.pass([]byte("/workflow # "))...)
	got = append(got, d.rest()...)
	if string(got) != "ready\n" {
		t.Fatalf("kept %q", got)
	}
}

// A final state's file that cannot be written (here a directory stands in
// its place) does not stop the job's end: it is recorded and pullable,
// and the failure is in the runner's log. The file is written under the
// journal's clock, which the runner's log takes too: logging there hung
// the runner.
func TestJobEndsWhenItsFinalFileCannotBeWritten(t *testing.T) {
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, FinalFile, "x"), 0o755); err != nil {
		t.Fatal(err)
	}
	done := make(chan api.JobStateEvent, 1)
	go func() { done <- runJobFile(t, Config{TempDir: dir}, false, "/bin/sh", "-c", "exit 4") }()
	select {
	case ev := <-done:
		if ev.State != api.JobFailed || ev.ExitStatus == nil || *ev.ExitStatus != 4 {
			t.Fatalf("ended %+v", ev)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("the job's end hung on its final state's file")
	}
	b, _ := os.ReadFile(filepath.Join(dir, "runner.log"))
	if !strings.Contains(string(b), "could not leave the job's final state for the shim") {
		t.Fatalf("runner log:\n%s", b)
	}
}

// TestStdinModes: by default (dstack's runner) a job's stdin is its
// terminal; a Tandem client's "none" gives it one that ends at once, so a
// job that reads stdin goes on (as under docker run without -i) instead of
// waiting forever, with the terminal still its output. Any other mode is
// refused before anything is kept.
func TestStdinModes(t *testing.T) {
	if ev := runJob(t, Config{}, "sh", "-c", "[ -t 0 ] && exit 3"); ev.ExitStatus == nil || *ev.ExitStatus != 3 {
		t.Fatalf("default stdin: %+v, want the terminal (exit 3)", ev)
	}
	none := &api.SubmitExtras{Stdin: api.StdinNone}
	ev := runJobWith(t, Config{}, none, true, "sh", "-c", "cat; read -r x; [ -t 0 ] && exit 5; [ -t 1 ] && exit 4")
	if ev.ExitStatus == nil || *ev.ExitStatus != 4 {
		t.Fatalf("stdin none: %+v, want reads at their end and output on the terminal (exit 4)", ev)
	}
	x := newTestExecutor(t)
	for _, mode := range []string{"pipe", "NONE", "none ", "\x1b[2J"} {
		err := x.Submit(api.SubmitBody{Tandem: &api.SubmitExtras{Stdin: mode}})
		if !errors.Is(err, ErrBadInput) || x.State() != WaitSubmit {
			t.Fatalf("stdin %q: %v, state %s; want a refusal", mode, err, x.State())
		}
		if strings.Contains(err.Error(), "\x1b") {
			t.Fatalf("the refusal carries the raw escape: %q", err)
		}
	}
}
