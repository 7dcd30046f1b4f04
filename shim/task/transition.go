package task

// Status changes: every one goes through transition, which checks the table
// (api.TaskStatus.CanTransitionTo), applies the change under the task's own
// lock, persists the record as the change asks and, for the last change of
// a task, closes done.

import (
	"errors"
	"fmt"

	"github.com/tandem-run/tandem/api"
)

// errTransition means the task moved on (terminated) under the pipeline.
var errTransition = errors.New("status transition rejected")

// persist says when a change's record reaches the disk.
type persist int

const (
	// persistNone: recovery asks Docker about every record before running
	// alike (whether its container started), so writing preparing, pulling
	// and creating would buy nothing but fsyncs on the start path.
	persistNone persist = iota
	// persistSoon: written by the background writer, retried until it
	// lands (saveSoon).
	persistSoon
)

// change is one status change of a task.
type change struct {
	to api.TaskStatus
	// update changes more of the task with the status, under its lock.
	update func()
	// reason and msg say why a task terminated (to == terminated only).
	reason api.TerminationReason
	msg    string
	// recovered: recovery settles a restored record; it may skip steps to
	// running (the record lagged the container). A stop request that
	// the record carries does not block the step: the container exists
	// either way, a terminate that the restart cut short is retried by its
	// caller and then finds it running, and its reason is the one the task
	// ends with.
	recovered bool
	persist   persist
	// last: nothing more runs for the task after this change; done is
	// closed once its record is handled.
	last bool
}

// transition moves t as c says. A step the table forbids, or one forward
// while a terminate is pending, is refused with errTransition and changes
// nothing. Terminated is never refused: a reason already recorded wins, a
// terminate request's reason beats the pipeline's, and the reason is never
// empty.
func (e *Engine) transition(t *task, c change) error {
	t.mu.Lock()
	err := applyLocked(t, c)
	t.mu.Unlock()
	if err != nil {
		return err
	}
	if c.persist == persistSoon {
		e.saveSoon(t)
	}
	if c.to == api.TaskRunning || c.to == api.TaskTerminated {
		t.markSettled()
	}
	if c.last {
		t.markDone()
	}
	return nil
}

// applyLocked is transition's decision and change; t.mu is held.
func applyLocked(t *task, c change) error {
	if c.to == api.TaskTerminated {
		if t.status == api.TaskTerminated && t.reason != "" {
			return nil
		}
		reason, msg := c.reason, c.msg
		if t.stopReq != nil {
			reason, msg = t.stopReq.TerminationReason, t.stopReq.TerminationMessage
			if !reason.Valid() {
				reason = api.ReasonTerminatedByServer
			}
		}
		if !reason.Valid() {
			reason = api.ReasonExecutorError
		}
		if c.update != nil {
			c.update()
		}
		t.status, t.reason, t.message = api.TaskTerminated, reason, msg
		return nil
	}
	// Recovery may skip steps: a record written before running lags a
	// container that Docker says started.
	skip := c.recovered && c.to == api.TaskRunning && t.status != api.TaskRunning && t.status != api.TaskTerminated
	if !t.status.CanTransitionTo(c.to) && !skip {
		return fmt.Errorf("%w: %s -> %s", errTransition, t.status, c.to)
	}
	// A pending terminate blocks every step forward: the pipeline winds down.
	if t.stopReq != nil && !c.recovered {
		return fmt.Errorf("%w: terminate requested", errTransition)
	}
	if c.update != nil {
		c.update()
	}
	t.status = c.to
	return nil
}

// commit is a pipeline step to next. Only running is persisted (soon): what
// recovery needs is written where it happens (the submit, host keys before
// the edit, running with the container id, terminated, stop requests).
func (e *Engine) commit(t *task, next api.TaskStatus, update func()) error {
	p := persistNone
	if next == api.TaskRunning {
		p = persistSoon
	}
	return e.transition(t, change{to: next, update: update, persist: p})
}

// finish commits terminated, persisted soon, without closing done (the
// pipeline may still be winding down).
func (e *Engine) finish(t *task, reason api.TerminationReason, msg string) {
	_ = e.transition(t, change{to: api.TaskTerminated, reason: reason, msg: msg, persist: persistSoon})
}
