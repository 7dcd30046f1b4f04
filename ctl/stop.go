package ctl

import (
	"context"
	"sync"
)

// stopper is how Stop reaches a run, whichever step it is at: before the
// job runs it cancels the run (with ErrInterrupted); once the job runs it
// is a request to the follower, which stops the job gracefully.
type stopper struct {
	stops chan struct{} // requests once the job runs; buffered

	mu      sync.Mutex
	cancel  context.CancelCauseFunc // the run's, while it is under way
	running bool                    // the job was started
	early   bool                    // Stop came before the run was under way
}

func newStopper() *stopper { return &stopper{stops: make(chan struct{}, 4)} }

// Stop asks the run to end early, as a Ctrl-C does: before the job runs it
// cancels the run (which then returns ErrInterrupted); while it runs, the
// job is stopped gracefully and followed to its end. Cancelling the run's
// context instead ends it at once: its tasks are torn down with no grace.
// Safe from any goroutine, any number of times.
func (s *stopper) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.running:
		select {
		case s.stops <- struct{}{}:
		default:
		}
	case s.cancel != nil:
		s.cancel(ErrInterrupted)
	default:
		s.early = true
	}
}

// begin derives the run's context from ctx; a Stop that came before
// cancels it at once.
func (s *stopper) begin(ctx context.Context) (context.Context, context.CancelCauseFunc) {
	ctx, cancel := context.WithCancelCause(ctx)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cancel = cancel
	if s.early {
		cancel(ErrInterrupted)
	}
	return ctx, cancel
}

// started says the job runs: from now on Stop goes to the follower.
func (s *stopper) started() {
	s.mu.Lock()
	s.running = true
	s.mu.Unlock()
}
