package fastpull

import (
	"context"
	"encoding/json"
	"io"
	"sync"
	"time"
)

// hub is one pull's progress stream, in Docker's JSON line format, for
// every task waiting on that pull: each reader starts at the first line.
// Its memory is bounded: past maxHubBytes only lines that are not byte
// counts are kept (a reader then sees the count jump at the next one).
type hub struct {
	mu     sync.Mutex
	lines  [][]byte
	size   int
	err    error // set once closed; io.EOF on success
	notify chan struct{}
}

const maxHubBytes = 4 << 20

func newHub() *hub { return &hub{notify: make(chan struct{})} }

func (h *hub) add(line []byte, counts bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.err != nil || (counts && h.size+len(line) > maxHubBytes) {
		return
	}
	h.lines = append(h.lines, line)
	h.size += len(line)
	close(h.notify)
	h.notify = make(chan struct{})
}

func (h *hub) close(err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.err != nil {
		return
	}
	if err == nil {
		err = io.EOF
	}
	h.err = err
	close(h.notify)
}

// reader is one task's view of the hub; ctx is that task's.
type reader struct {
	ctx   context.Context
	h     *hub
	next  int
	buf   []byte
	leave func()
	once  sync.Once
}

func (r *reader) Read(p []byte) (int, error) {
	for len(r.buf) == 0 {
		r.h.mu.Lock()
		if r.next < len(r.h.lines) {
			r.buf = r.h.lines[r.next]
			r.next++
			r.h.mu.Unlock()
			break
		}
		err, wait := r.h.err, r.h.notify
		r.h.mu.Unlock()
		if err != nil {
			return 0, err
		}
		select {
		case <-wait:
		case <-r.ctx.Done():
			return 0, r.ctx.Err()
		}
	}
	n := copy(p, r.buf)
	r.buf = r.buf[n:]
	return n, nil
}

func (r *reader) Close() error {
	r.once.Do(r.leave)
	return nil
}

// hubWriter feeds another stream (Docker's pull, the fallback) into the
// hub line by line.
type hubWriter struct {
	h       *hub
	partial []byte
}

func (w *hubWriter) Write(p []byte) (int, error) {
	n := len(p)
	for len(p) > 0 {
		i := indexByte(p, '\n')
		if i < 0 {
			if len(w.partial)+len(p) > 1<<20 {
				w.partial = w.partial[:0] // a line this long is no progress line
				return n, nil
			}
			w.partial = append(w.partial, p...)
			return n, nil
		}
		line := append(append([]byte(nil), w.partial...), p[:i+1]...)
		w.partial = w.partial[:0]
		w.h.add(line, false)
		p = p[i+1:]
	}
	return n, nil
}

func indexByte(p []byte, c byte) int {
	for i, b := range p {
		if b == c {
			return i
		}
	}
	return -1
}

// event is one line in Docker's pull stream format (shim/pull parses it).
type event struct {
	ID             string `json:"id,omitempty"`
	Status         string `json:"status"`
	ProgressDetail *struct {
		Current int64 `json:"current"`
		Total   int64 `json:"total"`
	} `json:"progressDetail,omitempty"`
	// Error and ErrorDetail are read from Docker's stream (relayPull);
	// this package never writes them.
	Error       string `json:"error,omitempty"`
	ErrorDetail *struct {
		Message string `json:"message"`
	} `json:"errorDetail,omitempty"`
}

// progress writes a pull's events, byte counts at most every 200 ms per
// layer and phase.
type progress struct {
	h    *hub
	now  func() time.Time
	mu   sync.Mutex
	last map[string]time.Time
}

func newProgress(h *hub, now func() time.Time) *progress {
	return &progress{h: h, now: now, last: map[string]time.Time{}}
}

func (p *progress) status(id, status string) {
	b, _ := json.Marshal(event{ID: id, Status: status})
	p.h.add(append(b, '\n'), false)
}

// count reports current of total bytes of layer id in phase status
// ("Downloading", "Extracting"); force writes it whatever the time.
func (p *progress) count(id, status string, current, total int64, force bool) {
	key := id + status
	p.mu.Lock()
	t := p.now()
	if !force && t.Sub(p.last[key]) < 200*time.Millisecond {
		p.mu.Unlock()
		return
	}
	p.last[key] = t
	p.mu.Unlock()
	ev := event{ID: id, Status: status}
	ev.ProgressDetail = &struct {
		Current int64 `json:"current"`
		Total   int64 `json:"total"`
	}{current, total}
	b, _ := json.Marshal(ev)
	p.h.add(append(b, '\n'), true)
}
