package task

// Giving back what a task holds: in reverse acquire order, what fails
// kept in its record (holds) and retried.

import (
	"log/slog"
	"slices"
	"time"
)

// release gives back the task's host resources, in reverse order, exactly
// once.
func (e *Engine) release(t *task, log *slog.Logger) {
	t.mu.Lock()
	if t.released || t.releasing {
		t.mu.Unlock()
		return
	}
	t.releasing = true
	only := slices.Clone(t.holding) // after a restart: what is still held
	t.mu.Unlock()
	if len(e.releaseKinds(t, log, only)) == 0 {
		return
	}
	e.retries.Add(1)
	go func() {
		defer e.retries.Done()
		e.retryRelease(t, log)
	}()
}

// releaseKinds releases, in reverse acquire order, the kinds named in only
// (every kind when empty), records what is still held and returns it
// (none: all given back). The record is written either way.
func (e *Engine) releaseKinds(t *task, log *slog.Logger, only []string) (held []string) {
	for i := len(e.resources) - 1; i >= 0; i-- {
		r, ok := e.resources[i].(releaser)
		if !ok || len(only) > 0 && !slices.Contains(only, e.resources[i].kind()) {
			continue
		}
		if err := r.release(t, log); err != nil {
			log.Error("release failed; retried", "resource", e.resources[i].kind(), "err", err)
			held = append(held, e.resources[i].kind())
		}
	}
	t.mu.Lock()
	t.holding = held
	if len(held) == 0 {
		t.released, t.releasing = true, false
	}
	t.mu.Unlock()
	e.saveSoon(t)
	return held
}

// heldKinds is what t still holds after a failed release.
func (t *task) heldKinds() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return slices.Clone(t.holding)
}

// Backoff of failed releases: a few minutes of tries while the shim runs;
// the record keeps what is held, so the next start tries again.
const (
	releaseRetryFirst = time.Second
	releaseRetryMax   = time.Minute
	releaseRetries    = 8
)

// retryRelease retries what t still holds until it is given back, the
// tries run out, or the shim shuts down.
func (e *Engine) retryRelease(t *task, log *slog.Logger) {
	backoff := e.releaseBackoff
	if backoff == 0 {
		backoff = releaseRetryFirst
	}
	for try := 1; try <= releaseRetries; try++ {
		select {
		case <-e.life.Done():
			return
		case <-time.After(backoff):
		}
		held := t.heldKinds()
		if len(held) == 0 || len(e.releaseKinds(t, log, held)) == 0 {
			log.Info("released after a retry", "resources", held, "tries", try)
			return
		}
		backoff = min(2*backoff, releaseRetryMax)
	}
	t.mu.Lock()
	held := slices.Clone(t.holding)
	t.releasing = false
	t.mu.Unlock()
	log.Error("the task still holds resources whose release keeps failing; the next shim start tries again", "resources", held)
}
