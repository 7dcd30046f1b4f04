package task

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/internal/diskfill"
	"github.com/tandem-run/tandem/shim/gpu"
)

// smallHome mounts a tmpfs of size bytes as a shim home (root only).
func smallHome(t *testing.T, size string) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a tmpfs")
	}
	dir := t.TempDir()
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size="+size, "tmpfs", dir).CombinedOutput(); err != nil {
		t.Skipf("mount tmpfs: %v %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("umount", "-l", dir).Run() })
	return dir
}

func storageEngine(t *testing.T, home string, rt Runtime) *Engine {
	t.Helper()
	runner := filepath.Join(t.TempDir(), "runner")
	_ = os.WriteFile(runner, nil, 0o755)
	e := New(Config{Home: home, SpillDir: home + ".spill", RunnerBinary: runner, RunnerHTTPPort: 10999, RunnerSSHPort: 10022,
		RunnerLogLevel: "info", InfinibandPath: "/nonexistent/ib", TerminateWait: 5 * time.Second},
		rt, gpu.NewLocks(nil), nil, logging.Discard())
	t.Cleanup(func() { e.Shutdown(); e.Sync() })
	return e
}

// A submit on a full home is refused with ErrStorage before anything
// starts; with room again the same submit works (control).
func TestSubmitOnFullHomeIsRefusedAndStartsNothing(t *testing.T) {
	home := smallHome(t, "1m")
	rt := newStepRuntime()
	e := storageEngine(t, home, rt)
	if e.recs.reserve.held {
		t.Fatal("a reserve must not be taken where the filesystem has no room for it four times over")
	}
	diskfill.Full(t, filepath.Join(home, "filler"))
	_, err := e.Submit(api.TaskConfig{ID: "full", Name: "n", ImageName: "img"})
	if !errors.Is(err, ErrStorage) {
		t.Fatalf("submit on a full home: %v", err)
	}
	if len(e.List()) != 0 || rt.live() != 0 {
		t.Fatalf("a refused submit left a task (%v) or a container (%d)", e.List(), rt.live())
	}
	if _, err := e.Get("full"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("refused task answers: %v", err)
	}
	_ = os.Remove(filepath.Join(home, "filler"))
	if _, err := e.Submit(api.TaskConfig{ID: "full", Name: "n", ImageName: "img"}); err != nil {
		t.Fatalf("control: submit with room: %v", err)
	}
	waitStatus(t, e, "full", api.TaskRunning)
}

// The reserve: a job fills the home while a task runs; its terminal state
// and the stop request's reason still reach the disk (the reserve is given
// back), and a restarted shim reports the same reason.
func TestReserveKeepsTerminalStateOnFullHome(t *testing.T) {
	home := smallHome(t, "64m")
	rt := newStepRuntime()
	e := storageEngine(t, home, rt)
	if _, err := e.Submit(api.TaskConfig{ID: "a", Name: "a", ImageName: "img"}); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, e, "a", api.TaskRunning)
	e.Sync()
	if fi, err := os.Stat(filepath.Join(home, ".state-reserve")); err != nil || fi.Size() != defaultReserve {
		t.Fatalf("reserve after the first record: %v %v", fi, err)
	}
	diskfill.Full(t, filepath.Join(home, "runners", "job-filler"))
	if _, err := e.Terminate(context.Background(), "a", api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByServer, TerminationMessage: "bye"}); err != nil {
		t.Fatal(err)
	}
	e.Sync()
	if _, err := os.Stat(filepath.Join(home, ".state-reserve")); !os.IsNotExist(err) {
		t.Fatalf("the reserve should have been given back: %v", err)
	}
	e2 := storageEngine(t, home, rt)
	if err := e2.Restore(context.Background()); err != nil {
		t.Fatal(err)
	}
	info, err := e2.Get("a")
	if err != nil || info.Status != api.TaskTerminated || info.TerminationReason != api.ReasonTerminatedByServer {
		t.Fatalf("after a restart on a full home: %+v %v", info, err)
	}
}

// Without a reserve (none could be taken), a terminal state that fails to
// persist is retried until it lands.
func TestTerminalStateIsRetriedUntilPersisted(t *testing.T) {
	home := smallHome(t, "64m")
	rt := newStepRuntime()
	e := storageEngine(t, home, rt)
	e.recs.reserve = nil
	if _, err := e.Submit(api.TaskConfig{ID: "a", Name: "a", ImageName: "img"}); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, e, "a", api.TaskRunning)
	e.Sync()
	filler := filepath.Join(home, "filler")
	diskfill.Full(t, filler)
	if _, err := e.Terminate(context.Background(), "a", api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByServer}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(600 * time.Millisecond) // a few failed attempts
	var rec record
	if ls, _ := readRecords(e.recs.dir); len(ls) == 1 {
		rec = ls[0].rec
	}
	if rec.Status == api.TaskTerminated {
		t.Fatal("the disk is full: the record cannot have been written yet")
	}
	// It waits in the spill directory, where a restart finds it (issue
	// 39, item 4): a second engine on the still full home answers with the
	// terminate's reason, not the stale record's running.
	if ls, _ := readRecords(e.recs.spill); len(ls) != 1 || ls[0].rec.Status != api.TaskTerminated {
		t.Fatalf("spilled: %+v", ls)
	}
	e2 := storageEngine(t, home, rt)
	e2.recs.reserve = nil
	if err := e2.Restore(context.Background()); err != nil {
		t.Fatal(err)
	}
	if info, err := e2.Get("a"); err != nil || info.Status != api.TaskTerminated || info.TerminationReason != api.ReasonTerminatedByServer {
		t.Fatalf("after a restart on the full home: %+v %v", info, err)
	}
	_ = os.Remove(filler)
	e.Sync()
	ls, err := readRecords(e.recs.dir)
	if err != nil || len(ls) != 1 || ls[0].rec.Status != api.TaskTerminated || ls[0].rec.Reason != api.ReasonTerminatedByServer {
		t.Fatalf("after space came back: %+v %v", ls, err)
	}
	if ls, _ := readRecords(e.recs.spill); len(ls) != 0 {
		t.Fatalf("the spill outlived the write home: %+v", ls)
	}
}
