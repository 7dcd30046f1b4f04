package executor

import (
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/runner/logs"
)

// A driver that reads the job's output from /logs_ws pulls states only
// (tandem run). Its pulls never make the job wait for a journal it does not
// read: 4 MB of output through a job log that keeps 256 KiB, pulled at 100
// bytes a page, ends (with the old full pulls the job was held for pages
// nobody read). The answers carry no logs, last_updated moves to the
// newest event, and reading the end counts as the logs' collection.
func TestStatesOnlyPullsNeverHoldTheJob(t *testing.T) {
	logPath := filepath.Join(t.TempDir(), "runner.log") // a file: safe for the job's goroutines and the test
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { logFile.Close() })
	runnerLog := func() string { b, _ := os.ReadFile(logPath); return string(b) }
	x, err := New(Config{TempDir: t.TempDir(), PullCap: 100, ReaderGrace: time.Minute,
		LogRetention: logs.Retention{Head: 64 << 10, Max: 256 << 10}, Log: slog.New(slog.NewTextHandler(logFile, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { x.Close() })
	wd := t.TempDir()
	if err := x.Submit(api.SubmitBody{JobSpec: api.JobSpec{Commands: []string{"sh", "-c", "yes 0123456789abcdefghijklmnopqrstuvwxyz | head -c 4000000"}, WorkingDir: &wd, RepoDir: &wd}}); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := x.Run(); err != nil || !ok {
		t.Fatalf("run: %v %v", ok, err)
	}
	var ts int64
	var final api.JobStateEvent
	deadline := time.Now().Add(time.Minute)
	for final.State == "" || !final.State.Final() {
		if time.Now().After(deadline) {
			t.Fatalf("the job did not end while states were pulled; runner log:\n%s", runnerLog())
		}
		p, err := x.PullStates(ts)
		if err != nil {
			t.Fatal(err)
		}
		if len(p.JobLogs) != 0 || len(p.RunnerLogs) != 0 {
			t.Fatalf("a states-only pull carried %d job and %d runner log events", len(p.JobLogs), len(p.RunnerLogs))
		}
		if p.LastUpdated < ts {
			t.Fatalf("last_updated went back: %d after %d", p.LastUpdated, ts)
		}
		ts = p.LastUpdated
		if n := len(p.JobStates); n > 0 {
			final = p.JobStates[n-1]
		}
		time.Sleep(20 * time.Millisecond)
	}
	if final.State != api.JobDone {
		t.Fatalf("job ended %s: %+v", final.State, final)
	}
	if strings.Contains(runnerLog(), "job output is held") {
		t.Fatalf("the job was held for a states-only puller:\n%s", runnerLog())
	}
	waitFinished(t, x)
	if _, err := x.PullStates(ts); err != nil {
		t.Fatal(err)
	}
	select {
	case <-x.PullConsumed():
	default:
		t.Fatal("reading the end with a states-only pull did not count as the logs' collection")
	}
}

// An onlooker's look at the states (tandem attach) reads the end without
// collecting the logs: a job the dstack server drives is not ended for it
// (its runner would leave before the server's pull). The driver's pull of
// the end then collects them.
func TestPeekStatesDoesNotCollect(t *testing.T) {
	x, err := New(Config{TempDir: t.TempDir(), PullCap: 100})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { x.Close() })
	wd := t.TempDir()
	if err := x.Submit(api.SubmitBody{JobSpec: api.JobSpec{Commands: []string{"sh", "-c", "echo out"}, WorkingDir: &wd, RepoDir: &wd}}); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := x.Run(); err != nil || !ok {
		t.Fatalf("run: %v %v", ok, err)
	}
	waitFinished(t, x)
	for range 3 {
		p, err := x.PeekStates(0)
		if err != nil || len(p.JobLogs) != 0 || len(p.JobStates) == 0 || p.JobStates[len(p.JobStates)-1].State != api.JobDone {
			t.Fatalf("peek at the states: %v %+v (%d log events)", err, p.JobStates, len(p.JobLogs))
		}
	}
	select {
	case <-x.PullConsumed():
		t.Fatal("an onlooker's peek at the states counted as the logs' collection")
	default:
	}
	if _, err := x.PullStates(0); err != nil {
		t.Fatal(err)
	}
	select {
	case <-x.PullConsumed():
	default:
		t.Fatal("the driver's pull of the end did not collect")
	}
}
