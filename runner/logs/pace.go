package logs

import (
	"math"
	"sync"
	"time"
)

// DefaultReaderGrace is how long the job's output waits for a reader of
// /api/pull that has fallen behind. dstack's server pulls a running job at
// most every 5 s (its jobs pipeline's min_processing_interval), later when
// it is busy (20 workers share every job; a job's lock lasts 30 s): a
// reader silent for 60 s is taken as gone, and the job is not held for it
// any longer.
const DefaultReaderGrace = 60 * time.Second

// pacer holds the job's output back, as a terminal does when its reader
// does not read, while the reader of /api/pull is behind: appending more
// would make the log's bound drop what the reader has not had yet. It
// holds only for a reader that pulled within grace; with no reader (none
// yet, or one silent for grace) output flows and the bound drops the
// middle of it, with a marker.
type pacer struct {
	grace time.Duration // ≤ 0: never hold

	mu       sync.Mutex // guards the fields below
	acked    int64      // the reader has had every event up to here
	ackAt    time.Time  // its last pull (zero: none yet)
	released bool       // held no more (the job's output is ending)
	wake     chan struct{}
	// onHold hears the first time output is held, onGone each time a
	// reader that output waited for is given up on (either may be nil).
	onHold, onGone    func(behind int64)
	holding, heldOnce bool
}

func newPacer(grace time.Duration) *pacer {
	return &pacer{grace: grace, wake: make(chan struct{})}
}

// ack records a pull from after: the reader has had everything up to it.
func (p *pacer) ack(after int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.acked = max(p.acked, after)
	p.ackAt = time.Now()
	p.wakeLocked()
}

// release stops holding output back, for good.
func (p *pacer) release() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.released = true
	p.wakeLocked()
}

func (p *pacer) wakeLocked() {
	close(p.wake)
	p.wake = make(chan struct{})
}

// keepAll is a keep-after that keeps nothing back from the bound.
const keepAll = math.MaxInt64

// wait returns once behind(acked) says the next bytes fit beside what the
// reader has not had (≤ 0), the reader is gone, or the pacer is released.
// keepAfter is what the log's bound must not drop: the events after it,
// which a reader that pulled within grace has not had yet (keepAll: none).
func (p *pacer) wait(behind func(acked int64) int64) (keepAfter int64) {
	for {
		p.mu.Lock()
		if p.grace <= 0 || p.ackAt.IsZero() {
			p.mu.Unlock()
			return keepAll
		}
		left := p.grace - time.Since(p.ackAt)
		if left <= 0 {
			gone := p.holding
			p.holding = false
			p.mu.Unlock()
			if gone && p.onGone != nil {
				p.onGone(behind(keepAll))
			}
			return keepAll
		}
		acked := p.acked
		if p.released || behind(acked) <= 0 {
			p.holding = false
			p.mu.Unlock()
			return acked
		}
		first := !p.heldOnce
		p.holding, p.heldOnce = true, true
		wake := p.wake
		p.mu.Unlock()
		if first && p.onHold != nil {
			p.onHold(behind(acked))
		}
		t := time.NewTimer(left)
		select {
		case <-wake:
		case <-t.C:
		}
		t.Stop()
	}
}
