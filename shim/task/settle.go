package task

import (
	"context"
	"time"

	"github.com/tandem-run/tandem/api"
)

// AwaitSettled waits, at most max and while ctx lives, until task id runs,
// ended, or began a real registry pull, and returns what it is then.
//
// Why: dstack's server looks at a task 10-160 ms after its submit and,
// finding it not yet running, looks again only 5-10 s later
// (process_running_jobs). A submit answered once the task runs lets the
// first look start the job; one that needs a pull is answered when the
// pull begins, as before, so a registry's pace never holds the request.
func (e *Engine) AwaitSettled(ctx context.Context, id string, max time.Duration) (api.TaskInfoResponse, error) {
	t, ok := e.lookup(id)
	if !ok {
		return api.TaskInfoResponse{}, ErrNotFound
	}
	if max > 0 && t.settled != nil {
		timer := time.NewTimer(max)
		select {
		case <-t.settled:
		case <-timer.C:
		case <-ctx.Done():
		}
		timer.Stop()
	}
	return e.info(t), nil
}
