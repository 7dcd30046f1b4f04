package task

// Persistence: task records written synchronously where recovery needs them, coalesced in the background elsewhere.

import (
	"slices"
	"sync"
	"time"
)

// saveSoon persists t in the background, coalescing bursts into one write
// of the latest state. Used on the start path, where recovery already copes
// with a record one step behind (a pending or creating record whose
// container exists is reconciled or cleaned up), and for every state that
// must reach the disk eventually: a write that fails (a full disk) is
// retried with backoff until it lands, the task is removed or the shim
// shuts down, so a terminal status and its reason are never lost to one
// failed write.
func (e *Engine) saveSoon(t *task) {
	if e.recs == nil {
		return
	}
	t.mu.Lock()
	t.dirty = true
	if t.writing {
		t.mu.Unlock()
		return
	}
	t.writing = true
	t.mu.Unlock()
	e.writers.add()
	go func() {
		defer e.writers.done()
		backoff := retryFirst
		for {
			t.mu.Lock()
			if !t.dirty {
				t.writing = false
				t.mu.Unlock()
				return
			}
			t.dirty = false
			t.mu.Unlock()
			if err := e.save(t); err == nil {
				backoff = retryFirst
				continue
			}
			t.mu.Lock()
			t.dirty = true // whatever is newest now is written on the retry
			t.mu.Unlock()
			select {
			case <-time.After(backoff):
			case <-e.life.Done():
				t.mu.Lock()
				t.dirty = false
				t.mu.Unlock()
			}
			backoff = min(2*backoff, retryMax)
		}
	}()
}

// writerCount counts the background record writers, for Sync.
type writerCount struct {
	mu   sync.Mutex
	n    int
	idle sync.Cond // on mu; signalled when n drops to 0
}

func (w *writerCount) add() {
	w.mu.Lock()
	w.n++
	w.mu.Unlock()
}

func (w *writerCount) done() {
	w.mu.Lock()
	w.n--
	if w.n == 0 {
		w.idle.Broadcast()
	}
	w.mu.Unlock()
}

// Backoff of failed record writes.
const (
	retryFirst = 250 * time.Millisecond
	retryMax   = 10 * time.Second
)

// mustSave writes t's record now and, when that fails, keeps retrying in
// the background (saveSoon). For states that are already true (a stop
// requested, a container created) and must not be lost.
func (e *Engine) mustSave(t *task) {
	if err := e.save(t); err != nil {
		e.saveSoon(t)
	}
}

// Sync waits until no background record write is running.
func (e *Engine) Sync() {
	e.writers.mu.Lock()
	defer e.writers.mu.Unlock()
	for e.writers.n > 0 {
		e.writers.idle.Wait()
	}
}

// save writes t's record. Each call snapshots the latest state, and writes
// of one task are serialized, so the file never goes back in time. A
// removed task is not written (nil).
func (e *Engine) save(t *task) error {
	if e.recs == nil {
		return nil
	}
	t.saveMu.Lock()
	defer t.saveMu.Unlock()
	t.mu.Lock()
	if t.removed { // removed meanwhile: no resurrection
		t.mu.Unlock()
		return nil
	}
	rec := record{Config: t.cfg, Status: t.status, Reason: t.reason, Message: t.message, Held: heldOf(t),
		Released: t.released, Holds: slices.Clone(t.holding), StopRequest: t.stopReq, PasswordHash: t.pwHash,
		SubmittedAt: t.created, Job: t.job}
	t.mu.Unlock()
	if err := e.recs.save(rec); err != nil {
		e.log.Error("persist task", "task_id", t.cfg.ID, "status", rec.Status, "err", err)
		return err
	}
	return nil
}
