package ctl

import (
	"context"
	"errors"
	"time"
)

// Clock is the time ctl reads and waits on. It is injected (a test's
// clock runs a 30 s wait without sleeping) and every wait on it also ends
// with its context.
type Clock interface {
	Now() time.Time
	// After delivers once d has passed.
	After(d time.Duration) <-chan time.Time
}

type realClock struct{}

func (realClock) Now() time.Time                         { return time.Now() }
func (realClock) After(d time.Duration) <-chan time.Time { return time.After(d) }

// clockOr is c, or the real clock when nil.
func clockOr(c Clock) Clock {
	if c == nil {
		return realClock{}
	}
	return c
}

// errWaitedOut is a poll's limit passing with no error of try's to say.
var errWaitedOut = errors.New("timed out")

// poll calls try until it is done (its error is then poll's), limit has
// passed since the first call (try's last error, or errWaitedOut), or ctx
// ends (ctx's error); it waits every between calls. A limit ≤ 0 tries
// once.
func poll(ctx context.Context, clk Clock, every, limit time.Duration, try func() (done bool, err error)) error {
	return pollPaced(ctx, clk, pace{every: every}, limit, try)
}

// pace is how often a wait looks: every quick for its first quickFor,
// then every every.
type pace struct{ quick, quickFor, every time.Duration }

// after is the wait before the next look, elapsed into the wait.
func (p pace) after(elapsed time.Duration) time.Duration {
	if elapsed < p.quickFor {
		return p.quick
	}
	return p.every
}

// pollPaced is poll at the pace p.
func pollPaced(ctx context.Context, clk Clock, p pace, limit time.Duration, try func() (done bool, err error)) error {
	clk = clockOr(clk)
	start := clk.Now()
	deadline := start.Add(limit)
	for {
		done, err := try()
		if done {
			return err
		}
		if !clk.Now().Before(deadline) {
			if err == nil {
				err = errWaitedOut
			}
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-clk.After(p.after(clk.Now().Sub(start))):
		}
	}
}
