package task

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/shim/gpu"
)

// A second engine on the same home and runtime plays the restarted shim.
func TestRestoreRelocksGPUsAndNeverDoubleAllocates(t *testing.T) {
	rt := newStepRuntime()
	e1, _ := newEngine(t, rt, "g0", "g1")
	if _, err := e1.Submit(api.TaskConfig{ID: "a", Name: "a", ImageName: "img", GPU: 1}); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, e1, "a", api.TaskRunning)
	e1.Sync() // the restarted shim reads what reached the disk

	locks := gpu.NewLocks([]string{"g0", "g1"})
	e2 := New(e1.cfg, rt, locks, nil, logging.Discard())
	t.Cleanup(e2.Sync)
	if err := e2.Restore(context.Background()); err != nil {
		t.Fatal(err)
	}
	info, err := e2.Get("a")
	if err != nil || info.Status != api.TaskRunning || len(info.GPUIDs) != 1 || info.GPUIDs[0] != "g0" {
		t.Fatalf("restored: %+v %v", info, err)
	}
	if locks.Free() != 1 {
		t.Fatalf("the restored task's GPU must be locked again: free=%d", locks.Free())
	}
	if _, err := e2.Submit(api.TaskConfig{ID: "b", Name: "b", ImageName: "img", GPU: 2}); err != nil {
		t.Fatal(err)
	}
	if b := waitStatus(t, e2, "b", api.TaskTerminated); b.TerminationReason != api.ReasonExecutorError {
		t.Fatalf("b must not get a's GPU: %+v", b)
	}
	// a's exit after the restart releases its GPU exactly once.
	if _, err := e2.Terminate(context.Background(), "a", api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser}); err != nil {
		t.Fatal(err)
	}
	if locks.Free() != 2 {
		t.Fatalf("free after a ended: %d", locks.Free())
	}
	// Reconcile twice more: idempotent, nothing re-locked or re-released.
	_ = e2.Reconcile(context.Background())
	_ = e2.Reconcile(context.Background())
	if locks.Free() != 2 {
		t.Fatalf("reconcile changed locks: %d", locks.Free())
	}
	if _, err := os.Stat(filepath.Join(e1.cfg.Home, "tasks", "a.json")); err != nil {
		t.Fatalf("record: %v", err)
	}
}

// TestResubmitWithRegistryAuthAfterRestart: the record keeps only a salted
// hash of the registry password; the server's identical re-submit after a
// restart is still idempotent, a different password still conflicts, and
// the password itself is nowhere on disk.
func TestResubmitWithRegistryAuthAfterRestart(t *testing.T) {
	rt := newStepRuntime()
	e1, _ := newEngine(t, rt)
	cfg := api.TaskConfig{ID: "p", Name: "p", ImageName: "img", RegistryUsername: "u", RegistryPassword: "s3cret-pass"}
	if _, err := e1.Submit(cfg); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, e1, "p", api.TaskRunning)
	e1.Sync()
	b, err := os.ReadFile(filepath.Join(e1.cfg.Home, "tasks", "p.json"))
	if err != nil || strings.Contains(string(b), "s3cret-pass") || !strings.Contains(string(b), "registry_password_hash") {
		t.Fatalf("record: %s %v", b, err)
	}
	e2 := New(e1.cfg, rt, gpu.NewLocks(nil), nil, logging.Discard())
	t.Cleanup(e2.Sync)
	if err := e2.Restore(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := e2.Submit(cfg); err != nil {
		t.Fatalf("identical re-submit after restart: %v", err)
	}
	other := cfg
	other.RegistryPassword = "another"
	if _, err := e2.Submit(other); !errors.Is(err, ErrConflict) {
		t.Fatalf("different password: %v", err)
	}
	e2.Sync()
	b, _ = os.ReadFile(filepath.Join(e1.cfg.Home, "tasks", "p.json"))
	if !strings.Contains(string(b), "registry_password_hash") {
		t.Fatal("a rewrite after restore lost the hash")
	}
}
