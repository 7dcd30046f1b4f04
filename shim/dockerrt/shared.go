package dockerrt

import (
	"context"
	"sync"
	"time"
)

// shared lets concurrent callers asking the same question (is this image
// here?) share one Docker call: a burst of tasks of one image asks Docker
// once instead of once each, queued behind every create. Nothing is kept
// once the call returned, so a later caller always asks afresh.
type shared[T any] struct {
	mu    sync.Mutex
	calls map[string]*sharedCall[T]
}

type sharedCall[T any] struct {
	done chan struct{}
	val  T
	err  error
}

// forget makes the next caller for key start a call of its own, even
// while one is under way (its answer may be older than what the caller
// knows happened since).
func (s *shared[T]) forget(key string) {
	s.mu.Lock()
	delete(s.calls, key)
	s.mu.Unlock()
}

// sharedCallTimeout bounds the shared call, which outlives a caller that
// gave up (its context is not the call's).
const sharedCallTimeout = 30 * time.Second

// do returns f's answer for key: f runs once for all the callers that come
// while it runs, under a context of its own; each caller waits until its
// own ctx ends at most.
func (s *shared[T]) do(ctx context.Context, key string, f func(context.Context) (T, error)) (T, error) {
	s.mu.Lock()
	if s.calls == nil {
		s.calls = map[string]*sharedCall[T]{}
	}
	c, ok := s.calls[key]
	if !ok {
		c = &sharedCall[T]{done: make(chan struct{})}
		s.calls[key] = c
		go func() {
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), sharedCallTimeout)
			c.val, c.err = f(cctx)
			cancel()
			s.mu.Lock()
			if s.calls[key] == c {
				delete(s.calls, key)
			}
			s.mu.Unlock()
			close(c.done)
		}()
	}
	s.mu.Unlock()
	select {
	case <-c.done:
		return c.val, c.err
	case <-ctx.Done():
		var zero T
		return zero, ctx.Err()
	}
}
