package logs

import (
	"errors"
	"sync"
	"time"
)

// Quota bounds the stripped output a job may store per hour (dstack's
// log_quota_hour), in hour buckets counted from Start. PerHour ≤ 0: none.
type Quota struct {
	PerHour int64
	Start   time.Time
	Now     func() time.Time // time.Now when nil

	mu         sync.Mutex // guards hour, used
	hour, used int64
}

// Charge accounts n bytes in the current hour; false when they do not fit
// (nothing is charged then).
func (q *Quota) Charge(n int) bool {
	if q == nil || q.PerHour <= 0 {
		return true
	}
	now := time.Now
	if q.Now != nil {
		now = q.Now
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	hour := int64(now().Sub(q.Start) / time.Hour)
	if hour != q.hour {
		q.hour, q.used = hour, 0
	}
	if q.used+int64(n) > q.PerHour {
		return false
	}
	q.used += int64(n)
	return true
}

// Pipe carries one job's terminal output: every byte to the raw History
// (the WebSocket stream) and, stripped of terminal control, into the
// journal's job log under the hourly quota. Both happen in the reader's
// Write, in order: with the stripper at hundreds of MB/s, a queue and a
// goroutine beside the reader cost more than they saved (measured on 2
// cores: 52-54 MB/s through the pty with them, 58 without). Memory stays
// bounded by the stripper's own budget.
type Pipe struct {
	hist     *History
	stripper *Stripper
	quotaHit chan struct{}
	hitOnce  sync.Once
	err      error // the first history write error
}

// Pipe starts the output pipeline of a job into j and hist.
func (j *Journal) Pipe(hist *History, quota *Quota) *Pipe {
	p := &Pipe{hist: hist, quotaHit: make(chan struct{})}
	p.stripper = NewStripper(func(b []byte) {
		if !quota.Charge(len(b)) {
			p.hitOnce.Do(func() { close(p.quotaHit) })
			return
		}
		j.AppendJobLog(b)
	})
	return p
}

// Write takes one read of the terminal. Not safe for concurrent use: one
// reader feeds a pipe.
func (p *Pipe) Write(b []byte) (int, error) {
	if len(b) == 0 {
		return 0, nil
	}
	if _, err := p.hist.Write(b); err != nil && p.err == nil {
		p.err = err
	}
	return p.stripper.Write(b)
}

// QuotaHit is closed when the job's output passed its hourly quota.
func (p *Pipe) QuotaHit() <-chan struct{} { return p.quotaHit }

// Close stores the last partial line and returns the first history write
// error.
func (p *Pipe) Close() error {
	return errors.Join(p.err, p.stripper.Close())
}
