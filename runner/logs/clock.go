// Package logs owns the runner's log and event streams: the shared event
// clock, disk-backed event stores that keep memory flat whatever a job
// prints, the raw terminal history served over WebSocket, and the
// ANSI-stripping writer that turns terminal output into lines.
package logs

import (
	"sync"
	"time"
)

// Clock issues the timestamps of every pull stream: integer milliseconds
// since the epoch, strictly increasing. Under a burst it runs ahead of the
// wall clock by at most the burst size instead of saturating (dstack repeats
// values after 999 events per second and loses events on the next pull).
type Clock struct {
	now func() time.Time

	mu   sync.Mutex // guards last
	last int64
}

// NewClock returns a clock reading now (time.Now when nil).
func NewClock(now func() time.Time) *Clock {
	if now == nil {
		now = time.Now
	}
	return &Clock{now: now, last: now().UnixMilli() - 1}
}

// Next returns a timestamp greater than every one before it.
func (c *Clock) Next() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nextLocked()
}

func (c *Clock) nextLocked() int64 {
	ts := c.now().UnixMilli()
	if ts <= c.last {
		ts = c.last + 1
	}
	c.last = ts
	return ts
}

// Stamp issues the next timestamp and runs record with it before any other
// timestamp is issued or a snapshot taken: an event is either wholly in a
// snapshot or after its last_updated, never lost between two pulls.
func (c *Clock) Stamp(record func(ts int64)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	record(c.nextLocked())
}

// Lock runs f while no timestamp can be issued, so a snapshot of stores and
// the clock's Last are consistent.
func (c *Clock) Lock(f func(last int64)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	f(c.last)
}
