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

// MaxReaderHold bounds the time a job's output is held for its readers, in
// all, over the job's life: past it, output flows whoever pulls and the
// log's bound drops the middle, with its marker. A reader that moves on by
// one event a minute would otherwise hold the job forever; dstack's server
// at one page (2 MiB) per 5 s pull is held for at most this long in a day.
const MaxReaderHold = 10 * time.Minute

// pacer holds the job's output back, as a terminal does when its reader
// does not read, while the reader of /api/pull is behind: appending more
// would make the log's bound drop what the reader has not had yet. It
// holds only for a reader that pulled within grace; with no reader (none
// yet, or one silent for grace) output flows and the bound drops the
// middle of it, with a marker.
//
// Any caller of /api/pull may send any timestamp, so a pull counts as the
// reader's only when it is the first, moves the acknowledgement on, or has
// nothing to move on to (a caught-up reader of a quiet job). A pull from
// behind what was acknowledged (timestamp=0 every few seconds) reads, but
// holds nothing: it neither refreshes the grace nor moves the hold.
type pacer struct {
	grace   time.Duration // ≤ 0: never hold
	maxHold time.Duration // of holding in all (MaxReaderHold)
	now     func() time.Time

	mu       sync.Mutex // guards the fields below
	acked    int64      // the reader has had every event up to here
	ackAt    time.Time  // its last pull that counted (zero: none yet)
	released bool       // held no more (the job's output is ending)
	wake     chan struct{}
	// onHold hears the first time output is held, onGone each time a
	// reader that output waited for is given up on, onSpent once when the
	// holds reach maxHold in all (any may be nil).
	onHold, onGone    func(behind int64)
	onSpent           func(behind int64, held time.Duration)
	holding, heldOnce bool
	heldFor           time.Duration // held so far, up to lookedAt
	lookedAt          time.Time     // of the last decision
	spent             bool          // held maxHold: never again
}

func newPacer(grace time.Duration) *pacer {
	return &pacer{grace: grace, maxHold: MaxReaderHold, now: time.Now, wake: make(chan struct{})}
}

// ack records a pull from after: the reader has had everything up to it.
// caughtUp says that no event of the job's output follows after.
func (p *pacer) ack(after int64, caughtUp bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.ackAt.IsZero() && after <= p.acked && !caughtUp {
		return // a stray or stale pull: it moves nothing on
	}
	p.acked = max(p.acked, after)
	p.ackAt = p.now()
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
// reader has not had (≤ 0), the reader is gone, the holds are spent, or
// the pacer is released. keepAfter is what the log's bound must not drop:
// the events after it, which a reader that pulled within grace has not had
// yet (keepAll: none).
func (p *pacer) wait(behind func(acked int64) int64) (keepAfter int64) {
	for {
		p.mu.Lock()
		v := p.decideLocked(behind)
		wake := p.wake
		p.mu.Unlock()
		switch {
		case v.first && p.onHold != nil:
			p.onHold(behind(v.keep))
		case v.gone && p.onGone != nil:
			p.onGone(behind(keepAll))
		case v.spent && p.onSpent != nil:
			p.onSpent(behind(keepAll), p.maxHold)
		}
		if v.hold <= 0 {
			return v.keep
		}
		t := time.NewTimer(v.hold)
		select {
		case <-wake:
		case <-t.C:
		}
		t.Stop()
	}
}

// verdict is one decision of the pacer's.
type verdict struct {
	keep  int64         // what the bound must keep (keepAll: nothing)
	hold  time.Duration // > 0: hold output, looking again after this long
	first bool          // the job's first hold
	gone  bool          // a reader output waited for is given up on
	spent bool          // the holds reached maxHold just now
}

// decideLocked says whether output waits now, and counts the time it has
// waited since the last decision.
func (p *pacer) decideLocked(behind func(acked int64) int64) verdict {
	now := p.now()
	if p.holding {
		p.heldFor += now.Sub(p.lookedAt)
	}
	p.lookedAt = now
	wasHolding := p.holding
	p.holding = false
	switch {
	case p.grace <= 0 || p.ackAt.IsZero() || p.spent:
		return verdict{keep: keepAll}
	case p.heldFor >= p.maxHold:
		p.spent = true
		return verdict{keep: keepAll, spent: true}
	}
	left := p.grace - now.Sub(p.ackAt)
	if left <= 0 {
		return verdict{keep: keepAll, gone: wasHolding}
	}
	if p.released || behind(p.acked) <= 0 {
		return verdict{keep: p.acked}
	}
	first := !p.heldOnce
	p.holding, p.heldOnce = true, true
	return verdict{keep: p.acked, hold: min(left, p.maxHold-p.heldFor), first: first}
}
