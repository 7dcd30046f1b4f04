package sshd

import (
	"sync"
	"time"
)

// Tracker turns the server's own connection list into dstack's
// no_connections_secs: a connection counts as activity once it has lasted
// longer than MinAge (the server's short API tunnels do not); the answer is
// the whole seconds since the last such activity, 0 while one is open and
// before tracking started.
type Tracker struct {
	MinAge time.Duration

	mu       sync.Mutex // guards the fields below
	open     map[uint64]time.Time
	next     uint64
	started  bool
	lastSeen time.Time
}

// NewTracker returns a tracker with dstack's 10 s threshold.
func NewTracker() *Tracker {
	return &Tracker{MinAge: 10 * time.Second, open: map[uint64]time.Time{}}
}

// Start begins measuring (when the job starts running).
func (t *Tracker) Start(now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.started {
		t.started, t.lastSeen = true, now
	}
}

// Opened records a new connection and returns its handle.
func (t *Tracker) Opened(now time.Time) uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.next++
	t.open[t.next] = now
	return t.next
}

// Closed records the end of a connection.
func (t *Tracker) Closed(id uint64, now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	since, ok := t.open[id]
	delete(t.open, id)
	if ok && t.started && now.Sub(since) > t.MinAge && now.After(t.lastSeen) {
		t.lastSeen = now
	}
}

// Open returns the number of open connections.
func (t *Tracker) Open() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.open)
}

// NoConnectionsSecs reports whole seconds without a long-lived connection.
func (t *Tracker) NoConnectionsSecs(now time.Time) int64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.started {
		return 0
	}
	for _, since := range t.open {
		if now.Sub(since) > t.MinAge {
			t.lastSeen = now
			return 0
		}
	}
	return int64(now.Sub(t.lastSeen) / time.Second)
}
