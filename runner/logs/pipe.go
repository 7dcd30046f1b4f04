package logs

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"
)

// Quota bounds the output a job may produce per hour (dstack's
// log_quota_hour), in hour buckets counted from Start. Both what the
// terminal received (raw bytes: escape sequences cost disk too) and the
// stripped text it became (a cursor move can become many spaces) count;
// the larger of the two is charged. PerHour ≤ 0: none.
type Quota struct {
	PerHour int64
	Start   time.Time
	Now     func() time.Time // time.Now when nil

	mu            sync.Mutex // guards hour, raw, stripped
	hour          int64
	raw, stripped int64
}

// Charge accounts n stripped bytes in the current hour; false when they do
// not fit (nothing is charged then).
func (q *Quota) Charge(n int) bool { return q.charge(0, n) }

// ChargeRaw accounts n raw bytes; false when they do not fit (nothing is
// charged then).
func (q *Quota) ChargeRaw(n int) bool { return q.charge(n, 0) }

func (q *Quota) charge(raw, stripped int) bool {
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
		q.hour, q.raw, q.stripped = hour, 0, 0
	}
	if max(q.raw+int64(raw), q.stripped+int64(stripped)) > q.PerHour {
		return false
	}
	q.raw += int64(raw)
	q.stripped += int64(stripped)
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
	j        *Journal
	hist     *History
	stripper *Stripper
	quota    *Quota
	guard    *Guard
	quotaHit chan struct{}
	hitOnce  sync.Once
	err      error        // the first history write error
	notKept  int64        // bytes dropped since the guard stopped logging
	log      *slog.Logger // hears the guard's stops and starts
}

// Pipe starts the output pipeline of a job into j and hist; guard (may be
// nil) stops keeping output while the disk under the logs runs low.
func (j *Journal) Pipe(hist *History, quota *Quota, guard *Guard) *Pipe {
	p := &Pipe{j: j, hist: hist, quota: quota, guard: guard, quotaHit: make(chan struct{}), log: j.log}
	if guard != nil && guard.Log != nil {
		p.log = guard.Log
	}
	p.stripper = NewStripper(func(b []byte) {
		if !quota.Charge(len(b)) {
			p.hit()
			return
		}
		j.AppendJobLog(b)
	})
	return p
}

func (p *Pipe) hit() { p.hitOnce.Do(func() { close(p.quotaHit) }) }

// Write takes one read of the terminal. Not safe for concurrent use: one
// reader feeds a pipe.
func (p *Pipe) Write(b []byte) (int, error) {
	if len(b) == 0 {
		return 0, nil
	}
	if !p.quota.ChargeRaw(len(b)) {
		p.hit()
		return len(b), nil
	}
	ok, changed := p.guard.Allow(len(b))
	if !ok {
		if changed {
			free, floor := p.guard.Free()
			p.log.Warn("job output is no longer kept: the disk under the logs is nearly full", "free_bytes", free, "floor_bytes", floor)
			p.note(fmt.Sprintf("[tandem: the disk under this job's log has %d bytes free, under the floor of %d: output is not kept until space is freed; the job goes on]", free, floor))
		}
		p.notKept += int64(len(b))
		return len(b), nil
	}
	if changed {
		free, _ := p.guard.Free()
		p.log.Info("job output is kept again", "free_bytes", free, "not_kept_bytes", p.notKept)
		p.note(fmt.Sprintf("[tandem: output is kept again; %d bytes of it were not]", p.notKept))
		p.notKept = 0
	}
	if _, err := p.hist.Write(b); err != nil && p.err == nil {
		p.err = err
	}
	return p.stripper.Write(b)
}

// note puts a line of ours into both logs, on a line of its own.
func (p *Pipe) note(msg string) {
	_, _ = p.hist.Write([]byte("\r\n" + msg + "\r\n"))
	p.j.AppendJobLog([]byte(msg + "\n"))
}

// QuotaHit is closed when the job's output passed its hourly quota.
func (p *Pipe) QuotaHit() <-chan struct{} { return p.quotaHit }

// Close stores the last partial line and returns the first history write
// error.
func (p *Pipe) Close() error {
	return errors.Join(p.err, p.stripper.Close())
}
