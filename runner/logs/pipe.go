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
// journal's job log under the hourly quota. The reader only queues what it
// read; one goroutine beside it takes everything queued at once, writes it
// to the history in one call and strips it, so a busy job costs a few
// large writes instead of one per pty read (a pty hands out about 4 KiB a
// read). The queue is bounded: when the pipe falls behind, Write (and so
// the job) waits, and memory stays bounded.
type Pipe struct {
	hist     *History
	chunks   chan *[]byte
	bufs     sync.Pool
	stripper *Stripper
	done     chan struct{}
	quotaHit chan struct{}
	hitOnce  sync.Once
	err      error // the first history write error, read after done
}

const (
	pipeQueue = 64        // reads that may wait for the pipe
	pipeBatch = 256 << 10 // bytes handled in one step at most
)

// Pipe starts the output pipeline of a job into j and hist.
func (j *Journal) Pipe(hist *History, quota *Quota) *Pipe {
	p := &Pipe{hist: hist, chunks: make(chan *[]byte, pipeQueue), done: make(chan struct{}), quotaHit: make(chan struct{})}
	p.stripper = NewStripper(func(b []byte) {
		if !quota.Charge(len(b)) {
			p.hitOnce.Do(func() { close(p.quotaHit) })
			return
		}
		j.AppendJobLog(b)
	})
	go p.run()
	return p
}

func (p *Pipe) run() {
	defer close(p.done)
	batch := make([]byte, 0, pipeBatch)
	for c := range p.chunks {
		batch = append(batch[:0], *c...)
		p.bufs.Put(c)
		open := true
	more:
		for open && len(batch) < pipeBatch {
			select {
			case c, ok := <-p.chunks:
				if !ok {
					open = false
					break more
				}
				batch = append(batch, *c...)
				p.bufs.Put(c)
			default:
				break more
			}
		}
		if _, err := p.hist.Write(batch); err != nil && p.err == nil {
			p.err = err
		}
		_, _ = p.stripper.Write(batch)
		if !open {
			return
		}
	}
}

// Write takes one read of the terminal. Not safe for concurrent use: one
// reader feeds a pipe.
func (p *Pipe) Write(b []byte) (int, error) {
	if len(b) == 0 {
		return 0, nil
	}
	c, _ := p.bufs.Get().(*[]byte)
	if c == nil {
		c = new([]byte)
	}
	*c = append((*c)[:0], b...)
	p.chunks <- c
	return len(b), nil
}

// QuotaHit is closed when the job's output passed its hourly quota.
func (p *Pipe) QuotaHit() <-chan struct{} { return p.quotaHit }

// Close ends the input and waits until every byte is stored (the last
// partial line included); it returns the first history write error.
func (p *Pipe) Close() error {
	close(p.chunks)
	<-p.done
	return errors.Join(p.err, p.stripper.Close())
}
