// Package lifecycle is how an agent stops what it started: each part it
// starts registers its undo, and Stop runs them in reverse order, so that
// a part never outlives what it depends on.
package lifecycle

import (
	"context"
	"fmt"
)

// Stack holds the undo functions of started parts. The zero value is
// ready; it is not safe for concurrent use (agents start and stop their
// parts from one goroutine).
type Stack struct{ undo []func() }

// OnStop registers f to run at Stop, before everything registered earlier.
func (s *Stack) OnStop(f func()) { s.undo = append(s.undo, f) }

// Stop runs the registered functions, the last registered first, once
// each: a second Stop runs nothing.
func (s *Stack) Stop() {
	undo := s.undo
	s.undo = nil
	for i := len(undo) - 1; i >= 0; i-- {
		undo[i]()
	}
}

// Step is one part of an agent to start: Start makes it from what the
// steps before made and registers its undo (OnStop).
type Step struct {
	Name  string
	Start func(context.Context) error
}

// Start starts steps in order; the first that fails ends it with its
// error, named by its step (what started before it is stopped by Stop).
func (s *Stack) Start(ctx context.Context, steps ...Step) error {
	for _, st := range steps {
		if err := st.Start(ctx); err != nil {
			return fmt.Errorf("%s: %w", st.Name, err)
		}
	}
	return nil
}
