package task

// The start pipeline: a start walks the task's list (resource.go), the
// container is watched, and the task ends and gives back what it held.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/tandem-run/tandem/api"
)

// run is the start pipeline of one task; it returns when the task ended and
// its host resources are released.
func (e *Engine) run(ctx context.Context, t *task) {
	log := e.log.With("task_id", t.cfg.ID, "container", t.name)
	defer t.cancelPre()
	if f := e.start(ctx, t, log); f != nil {
		e.end(t, log, *f)
		return
	}
	e.watch(t, log)
}

// end releases the task's host resources, then commits terminated as its
// last change: a terminated task holds nothing, but what a failed release
// kept, which its record names (holds) and which is retried.
func (e *Engine) end(t *task, log *slog.Logger, f failure) {
	e.release(t, log)
	_ = e.transition(t, change{to: api.TaskTerminated, reason: f.reason, msg: f.msg, persist: persistSoon, last: true})
	t.mu.Lock()
	reason := t.reason // a stop request's reason wins over f's
	t.mu.Unlock()
	e.obs().TaskEnded(reason)
	level := slog.LevelInfo
	switch reason {
	case api.ReasonExecutorError, api.ReasonCreatingContainerError, api.ReasonContainerExitedWithError:
		level = slog.LevelWarn
	}
	log.Log(context.Background(), level, "task terminated", "reason", reason, "message", f.msg)
}

// reclaim re-takes, after a restart, what t's record (or container) says
// it holds, in acquire order, without touching the host. Harmless twice.
func (e *Engine) reclaim(t *task, log *slog.Logger) {
	for _, r := range e.resources {
		if r, ok := r.(reclaimer); ok {
			r.reclaim(t, log)
		}
	}
}

// watch waits for the running container to exit, whoever stops it, and
// ends the task with the matching reason.
func (e *Engine) watch(t *task, log *slog.Logger) {
	t.mu.Lock()
	id := t.held.Container.ID
	t.mu.Unlock()
	code, err := e.waitExit(e.life, id, log)
	if e.life.Err() == nil {
		e.learnJob(t) // before anything else: the job's own word on its end
	}
	if e.life.Err() != nil {
		// The shim is shutting down: the task keeps running, and the next
		// start re-attaches to it. Nothing to end, but nothing more runs
		// for it here either.
		t.markDone()
		return
	}
	e.end(t, log, e.exitEnd(id, code, err, log))
}

// exitEnd is how a task whose container stopped ends: done with exit code
// 0, else with the container's last lines (or its code) as the message.
// err is the wait's failure, if any.
func (e *Engine) exitEnd(id string, code int, err error, log *slog.Logger) failure {
	switch {
	case errors.Is(err, ErrContainerGone):
		return failure{api.ReasonContainerExitedWithError, "the container disappeared"}
	case err != nil:
		return failure{api.ReasonContainerExitedWithError, err.Error()}
	case code == 0:
		return failure{api.ReasonDoneByRunner, ""}
	}
	lctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	tailText, lerr := e.rt.LogTail(lctx, id, 5)
	cancel()
	if lerr != nil {
		log.Warn("read container log tail", "err", lerr)
	}
	if tailText == "" {
		tailText = fmt.Sprintf("container exited with code %d", code)
	}
	return failure{api.ReasonContainerExitedWithError, tailText}
}

// waitExit waits for a container to stop, until ctx ends. A wait cut by a
// Docker restart is resumed (the task stays running meanwhile); only a
// container that is really gone or stopped ends it.
func (e *Engine) waitExit(ctx context.Context, id string, log *slog.Logger) (int, error) {
	backoff := 500 * time.Millisecond
	for {
		code, err := e.rt.Wait(ctx, id)
		if err == nil {
			return code, nil
		}
		if ctx.Err() != nil {
			return -1, ctx.Err()
		}
		ictx, cancel := context.WithTimeout(ctx, dockerCallTimeout)
		st, ierr := e.rt.Inspect(ictx, id)
		cancel()
		switch {
		case errors.Is(ierr, ErrContainerGone):
			return -1, ErrContainerGone
		case ierr == nil && !st.Running:
			return st.ExitCode, nil
		}
		log.Warn("lost the wait on the container; retrying", "err", err, "retry_in", backoff)
		select {
		case <-ctx.Done():
			return -1, ctx.Err()
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, 10*time.Second)
	}
}

// start takes, in order, everything a running task holds (resource.go: the
// runner dir, the host's resources, the image, the container, its ports),
// then commits running. A nil result means the container runs; what the
// task holds is given back by release when it ends.
func (e *Engine) start(ctx context.Context, t *task, log *slog.Logger) *failure {
	s := &starting{ctx: ctx, t: t, log: log, now: e.now, began: e.now(),
		// The timing line: the record write, then each stage since the
		// last (prepare, pull: the image check when it is local, create,
		// start, commit: ports and the running status, its record queued
		// for the background writer), then submit to running.
		phases: []any{"record", t.recordTook.Round(100 * time.Microsecond)}}
	defer s.finish()
	if err := e.commit(t, api.TaskPreparing, nil); err != nil {
		return aborted()
	}
	for _, r := range e.resources {
		if r, ok := r.(acquirer); ok {
			if f := r.acquire(s); f != nil {
				return f
			}
		}
	}
	if err := e.commit(t, api.TaskRunning, func() { t.held.Container.Ports, t.held.Container.Published, t.watched = s.ports, s.published, true }); err != nil {
		// Terminated while we were starting it: do not leave it running.
		_ = e.rt.Stop(context.WithoutCancel(ctx), s.id, 0)
		return aborted()
	}
	s.mark("commit")
	if !t.submitted.IsZero() {
		s.phases = append(s.phases, "total", e.now().Sub(t.submitted).Round(100*time.Microsecond))
	}
	log.Info("task running", append([]any{"container_id", s.id, "ports", s.ports, "gpus", s.gpus}, s.phases...)...)
	if !t.submitted.IsZero() {
		e.obs().TaskRunning(e.now().Sub(t.submitted))
	}
	return nil
}
