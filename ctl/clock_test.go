package ctl

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"
)

// fakeClock moves only when waited on: a wait of d passes at once, and
// the clock reads d later.
type fakeClock struct {
	mu    sync.Mutex
	now   time.Time
	waits int
	stuck bool // After never delivers
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) After(d time.Duration) <-chan time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	ch := make(chan time.Time, 1)
	if c.stuck {
		return ch
	}
	c.waits++
	c.now = c.now.Add(d)
	ch <- c.now
	return ch
}

// The waits of ctl run on its clock: a 30 s limit passes without 30 s
// passing, after the tries it allows; a done try ends it; a cancelled
// context ends a wait that would never end.
func TestPollRunsOnTheClock(t *testing.T) {
	ctx := context.Background()
	began := time.Now()

	clk := &fakeClock{now: time.Unix(1000, 0)}
	tries := 0
	err := poll(ctx, clk, 300*time.Millisecond, 30*time.Second, func() (bool, error) {
		tries++
		return false, errors.New("still down")
	})
	if err == nil || err.Error() != "still down" || tries != 101 || clk.waits != 100 {
		t.Fatalf("limit: %v after %d tries, %d waits", err, tries, clk.waits)
	}

	clk = &fakeClock{now: time.Unix(1000, 0)}
	tries = 0
	err = poll(ctx, clk, time.Second, time.Minute, func() (bool, error) { tries++; return tries == 3, nil })
	if err != nil || tries != 3 || clk.waits != 2 {
		t.Fatalf("done: %v after %d tries, %d waits", err, tries, clk.waits)
	}
	if err := poll(ctx, clk, time.Second, time.Minute, func() (bool, error) { return false, nil }); !errors.Is(err, errWaitedOut) {
		t.Fatalf("no error of try's: %v", err)
	}
	if time.Since(began) > 2*time.Second {
		t.Fatalf("the waits slept: %v", time.Since(began))
	}

	cctx, cancel := context.WithCancel(ctx)
	go func() { time.Sleep(50 * time.Millisecond); cancel() }()
	err = poll(cctx, &fakeClock{stuck: true}, time.Hour, 24*time.Hour, func() (bool, error) { return false, nil })
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled: %v", err)
	}
}

// A paced poll looks at the quick pace for its first stretch, then at the
// slow one, and its limit still holds: a run sees a started task and its
// runner moments after they are up, and a long pull is not asked after
// at the quick pace.
func TestPollPacedLooksQuicklyFirst(t *testing.T) {
	clk := &recordingClock{fakeClock: fakeClock{now: time.Unix(1000, 0)}}
	p := pace{quick: 10 * time.Millisecond, quickFor: 50 * time.Millisecond, every: 100 * time.Millisecond}
	err := pollPaced(context.Background(), clk, p, 300*time.Millisecond, func() (bool, error) { return false, nil })
	if !errors.Is(err, errWaitedOut) {
		t.Fatalf("limit: %v", err)
	}
	want := []time.Duration{10, 10, 10, 10, 10, 100, 100, 100}
	for i := range want {
		want[i] *= time.Millisecond
	}
	if !slices.Equal(clk.waited, want) {
		t.Fatalf("waits %v, want %v", clk.waited, want)
	}
	if got := taskPace.after(0); got > 20*time.Millisecond {
		t.Fatalf("a task's start is looked at every %v at first", got)
	}
	if got := runnerPace.after(0); got > 10*time.Millisecond {
		t.Fatalf("a runner's start is looked at every %v at first", got)
	}
	if got := waitPace.after(0); got > 100*time.Millisecond {
		t.Fatalf("tandem wait looks at a job every %v at first", got)
	}
}

// recordingClock is a fakeClock that keeps each wait asked for.
type recordingClock struct {
	fakeClock
	waited []time.Duration
}

func (c *recordingClock) After(d time.Duration) <-chan time.Time {
	c.waited = append(c.waited, d)
	return c.fakeClock.After(d)
}
