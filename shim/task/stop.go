package task

// Stopping and removing tasks.

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/tandem-run/tandem/api"
)

// StopError is a failure to stop a running container (HTTP 500).
type StopError struct{ Err error }

func (e *StopError) Error() string { return "failed to stop container: " + e.Err.Error() }

func (e *StopError) Unwrap() error { return e.Err }

// Terminate stops a task. It returns once the task is terminated and its
// resources released (or after TerminateWait if the pipeline is stuck).
// Terminating a terminated task keeps its first reason.
//
// Once asked, the stop is the task's, not the caller's: a caller that
// leaves (dstack's server gives up on every call after 9 s, and 64
// containers stopping at once on a busy host take longer) gets its
// context's error at once, while the stop and the wind-down go on to their
// end under their own bound and the task's op lock. Cancelling Docker's
// stop half way would leave the task running with its stop recorded, to be
// asked again; now the next call finds it terminated.
func (e *Engine) Terminate(ctx context.Context, id string, req api.TaskTerminateRequest) (api.TaskInfoResponse, error) {
	t, err := e.lockOp(ctx, id)
	if err != nil {
		return api.TaskInfoResponse{}, err
	}
	bound := time.Duration(req.Timeout)*time.Second + e.cfg.TerminateWait + dockerCallTimeout
	own, cancel := context.WithTimeout(context.WithoutCancel(ctx), bound)
	unhook := context.AfterFunc(e.life, cancel) // the shim's shutdown ends it
	type result struct {
		info api.TaskInfoResponse
		err  error
	}
	res := make(chan result, 1)
	e.stops.Add(1)
	go func() {
		defer e.stops.Done()
		defer cancel()
		defer unhook()
		defer t.op.Unlock()
		info, err := e.terminateLocked(own, t, id, req)
		if err != nil && ctx.Err() != nil {
			e.log.Warn("a terminate whose caller left failed", "task_id", id, "err", err)
		}
		res <- result{info, err}
	}()
	select {
	case r := <-res:
		return r.info, r.err
	case <-ctx.Done():
		e.log.Info("terminate goes on after its caller left", "task_id", id, "err", ctx.Err())
		return api.TaskInfoResponse{}, ctx.Err()
	}
}

// terminateLocked is Terminate's work, with t.op held; ctx is the stop's
// own (see Terminate).
func (e *Engine) terminateLocked(ctx context.Context, t *task, id string, req api.TaskTerminateRequest) (api.TaskInfoResponse, error) {
	t.mu.Lock()
	if t.status == api.TaskTerminated {
		info := e.infoLocked(t)
		t.mu.Unlock()
		return info, nil
	}
	if t.stopReq == nil {
		r := req
		t.stopReq = &r
	}
	status, contID, probing := t.status, t.held.Container.ID, t.probing
	t.mu.Unlock()
	e.mustSave(t) // the reason must survive a restart: retried until written

	t.cancelPre()
	if probing {
		// Restored before running and Docker has not answered yet: a
		// container may run under the task's name. Settle the task
		// first: Reconcile takes the container under that name only if
		// it is this shim's (never another agent's of the same name),
		// then the stop below reaches it by id. Without an answer nothing
		// could say whether its container runs, so the caller is told to
		// retry, as for a running task whose stop failed; the stop
		// request is kept.
		if err := e.Reconcile(ctx); err != nil {
			return api.TaskInfoResponse{}, &StopError{Err: err}
		}
		t.mu.Lock()
		status, contID = t.status, t.held.Container.ID
		t.mu.Unlock()
	}
	if status == api.TaskRunning && contID != "" {
		if err := e.rt.Stop(ctx, contID, time.Duration(req.Timeout)*time.Second); err != nil {
			return api.TaskInfoResponse{}, &StopError{Err: err}
		}
	}
	select {
	case <-t.done:
	case <-time.After(time.Duration(req.Timeout)*time.Second + e.cfg.TerminateWait):
		e.log.Warn("pipeline did not wind down in time; marking terminated", "task_id", id)
		e.finish(t, req.TerminationReason, req.TerminationMessage)
	case <-ctx.Done():
		return api.TaskInfoResponse{}, ctx.Err()
	}
	return e.Get(id)
}

// Remove forgets a terminated task, removing its container and runner dir.
func (e *Engine) Remove(ctx context.Context, id string) error {
	t, err := e.lockOp(ctx, id)
	if err != nil {
		return err
	}
	defer t.op.Unlock()
	t.mu.Lock()
	status := t.status
	t.mu.Unlock()
	if status != api.TaskTerminated {
		return fmt.Errorf("%w: cannot remove task %s with %s status", ErrConflict, id, status)
	}
	select {
	case <-t.done:
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(e.cfg.TerminateWait):
		e.log.Warn("removing a task whose pipeline is still winding down", "task_id", id)
	}
	// What it still holds (a release that failed) is tried once more now:
	// forgetting the task would leave it held for good (a host key line
	// granting logins, a mounted volume).
	if held := t.heldKinds(); len(held) > 0 {
		if held = e.releaseKinds(t, e.log.With("task_id", id), held); len(held) > 0 {
			return fmt.Errorf("%w: task %s still holds %s whose release fails (retried; see the shim's log): remove it again later", ErrConflict, id, strings.Join(held, ", "))
		}
	}
	// What outlives its end (the container, the runner dir), in reverse.
	// A task restored from an unreadable record has neither.
	if t.name != "" {
		for i := len(e.resources) - 1; i >= 0; i-- {
			if r, ok := e.resources[i].(remover); ok {
				if err := r.remove(ctx, t); err != nil {
					return err
				}
			}
		}
	}
	t.saveMu.Lock() // no save may write the record back after this
	t.mu.Lock()
	t.removed = true
	t.mu.Unlock()
	e.mu.Lock()
	delete(e.tasks, id)
	e.bury(id)
	e.mu.Unlock()
	t.saveMu.Unlock()
	if e.recs != nil {
		if err := e.recs.remove(id); err != nil {
			return err
		}
	}
	return nil
}

// lockOp takes the task's op lock, then checks the task still exists (a
// concurrent remove may have won the lock first). A caller whose context
// ends while another holds it (a stop that outlived its caller, up to the
// stop's bound) leaves with its context's error.
func (e *Engine) lockOp(ctx context.Context, id string) (*task, error) {
	t, ok := e.lookup(id)
	if !ok {
		return nil, ErrNotFound
	}
	if err := t.op.Lock(ctx); err != nil {
		return nil, err
	}
	if cur, ok := e.lookup(id); !ok || cur != t {
		t.op.Unlock()
		return nil, ErrNotFound
	}
	return t, nil
}

// opLock is a mutex whose waiters can give up (their context ends). Its
// zero value is unlocked.
type opLock struct {
	once sync.Once
	ch   chan struct{} // holds a value while locked
}

func (l *opLock) slot() chan struct{} {
	l.once.Do(func() { l.ch = make(chan struct{}, 1) })
	return l.ch
}

// Lock takes the lock, or returns ctx's error once ctx ends first.
func (l *opLock) Lock(ctx context.Context) error {
	select {
	case l.slot() <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Unlock gives the lock back; it must be held.
func (l *opLock) Unlock() { <-l.slot() }
