package logs

import (
	"sync"
	"time"
)

// Quota bounds the stripped output a job may store per hour (dstack's
// log_quota_hour), in hour buckets counted from Start. PerHour ≤ 0: none.
type Quota struct {
	PerHour int64
	Start   time.Time
	Now     func() time.Time // time.Now when nil

	mu          sync.Mutex // guards hour, used
	hour, used  int64
	initialized bool
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
	if !q.initialized || hour != q.hour {
		q.hour, q.used, q.initialized = hour, 0, true
	}
	if q.used+int64(n) > q.PerHour {
		return false
	}
	q.used += int64(n)
	return true
}

// Pipe carries one job's terminal output: every byte to the raw History
// (the WebSocket stream) and, stripped of terminal control, into the
// journal's job log under the hourly quota. Stripping runs beside the
// reader through a bounded queue: memory stays bounded, and when the
// stripper falls behind, Write (and so the job) waits.
type Pipe struct {
	hist     *History
	chunks   chan []byte
	stripper *Stripper
	done     chan struct{}
	quotaHit chan struct{}
	hitOnce  sync.Once
}

// pipeQueue is how many reads may wait for the stripper.
const pipeQueue = 64

// Pipe starts the output pipeline of a job into j and hist.
func (j *Journal) Pipe(hist *History, quota *Quota) *Pipe {
	p := &Pipe{hist: hist, chunks: make(chan []byte, pipeQueue), done: make(chan struct{}), quotaHit: make(chan struct{})}
	p.stripper = NewStripper(func(b []byte) {
		if !quota.Charge(len(b)) {
			p.hitOnce.Do(func() { close(p.quotaHit) })
			return
		}
		j.AppendJobLog(b)
	})
	go func() {
		defer close(p.done)
		for c := range p.chunks {
			_, _ = p.stripper.Write(c)
		}
	}()
	return p
}

// Write takes one read of the terminal. Not safe for concurrent use: one
// reader feeds a pipe.
func (p *Pipe) Write(b []byte) (int, error) {
	if len(b) == 0 {
		return 0, nil
	}
	if _, err := p.hist.Write(b); err != nil {
		return 0, err
	}
	p.chunks <- append([]byte(nil), b...)
	return len(b), nil
}

// QuotaHit is closed when the job's output passed its hourly quota.
func (p *Pipe) QuotaHit() <-chan struct{} { return p.quotaHit }

// Close ends the input and waits until every byte is stored (the last
// partial line included).
func (p *Pipe) Close() error {
	close(p.chunks)
	<-p.done
	return p.stripper.Close()
}
