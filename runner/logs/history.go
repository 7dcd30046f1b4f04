package logs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"sync"
	"time"
)

// History is the raw terminal output of the job (job.log on disk), served to
// WebSocket clients. Memory holds one index entry per second of output and
// a write-behind tail of at most historyTail bytes: a pty read is ~4 KiB,
// and a write syscall per read was a third of the pipeline's syscalls.
// Readers see the tail at once; the file gets it when it fills, and at Close.
type History struct {
	now func() time.Time

	mu      sync.Mutex // guards the fields below
	f       *os.File
	size    int64   // bytes written: the file's, then the tail's
	tail    []byte  // written but not yet in the file (starts at size-len(tail))
	secs    []int64 // unix second of each index entry
	offs    []int64 // first byte written in that second
	closed  bool
	changed chan struct{} // closed and replaced on a write once handed out; closed on close
	handed  bool          // a reader holds changed: the next write must close it
	written int64         // bytes in the file (size minus the tail)
	trim    trim          // what of the file stays on disk
	timer   *time.Timer   // flushes a tail that waited flushAfter; nil: none armed
}

// flushAfter bounds how long output waits in the tail: what the file (the
// shim's kept log, `tandem logs` of a running job) shows is at most this
// far behind the job.
const flushAfter = 250 * time.Millisecond

// OpenHistoryRetained creates (appends to) the raw log at path; r bounds
// what of it stays on disk. Readers skip the dropped middle and are told
// so in the stream.
func OpenHistoryRetained(path string, now func() time.Time, r Retention) (*History, error) {
	if now == nil {
		now = time.Now
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open job log: %w", err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("open job log: %w", err)
	}
	return &History{now: now, f: f, size: fi.Size(), changed: make(chan struct{}), trim: newTrim(r), written: fi.Size()}, nil
}

// historyTail is the write-behind size: dozens of pty reads per write, each
// write a system call that woke the runtime's monitor (16 -> 4 per MiB).
const historyTail = 256 << 10

// flushLocked moves the tail into the file, then gives back the middle of
// the file past its retention.
func (h *History) flushLocked() error {
	if len(h.tail) == 0 {
		return nil
	}
	n, err := h.f.Write(h.tail)
	h.written += int64(n)
	h.tail = h.tail[:0]
	if err != nil {
		return err
	}
	return h.trimLocked(h.written)
}

// trimLocked punches out what the file holds past its retention once it
// holds inFile bytes.
func (h *History) trimLocked(inFile int64) error {
	to := h.trim.plan(inFile)
	if to <= h.trim.dropEnd {
		return nil
	}
	if err := h.trim.punch(h.f, h.trim.dropEnd, to); err != nil {
		return err
	}
	// The index entries inside the hole point nowhere: drop them (memory
	// stays bounded for a job that runs for weeks).
	lo := sort.Search(len(h.offs), func(i int) bool { return h.offs[i] >= h.trim.r.Head })
	hi := sort.Search(len(h.offs), func(i int) bool { return h.offs[i] >= to })
	if hi > lo {
		h.secs = append(h.secs[:lo], h.secs[hi:]...)
		h.offs = append(h.offs[:lo], h.offs[hi:]...)
	}
	return nil
}

// Write appends raw output.
func (h *History) Write(p []byte) (int, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return 0, errors.New("history closed")
	}
	if h.trim.full(h.size) {
		// A filesystem without hole punching: past Max nothing more is
		// kept (readers see the head).
		return len(p), nil
	}
	sec := h.now().Unix()
	if n := len(h.secs); n == 0 || h.secs[n-1] != sec {
		h.secs = append(h.secs, sec)
		h.offs = append(h.offs, h.size)
	}
	// The tail holds less than historyTail between writes, so its
	// capacity of twice that takes any p up to historyTail; a bigger p
	// goes to the file itself, after the tail.
	var err error
	if len(p) > historyTail {
		ferr := h.flushLocked()
		n, werr := h.f.Write(p)
		h.written += int64(n)
		var terr error
		if werr == nil {
			terr = h.trimLocked(h.written)
		}
		err = errors.Join(ferr, werr, terr)
	} else {
		if h.tail == nil {
			h.tail = make([]byte, 0, 2*historyTail)
		}
		h.tail = append(h.tail, p...)
		if len(h.tail) >= historyTail {
			err = h.flushLocked()
		} else if h.timer == nil {
			h.timer = time.AfterFunc(flushAfter, h.timedFlush)
		}
	}
	h.size += int64(len(p))
	if h.handed { // nobody waits otherwise: no channel to replace per write
		close(h.changed)
		h.changed, h.handed = make(chan struct{}), false
	}
	if err != nil {
		return len(p), fmt.Errorf("write job log: %w", err)
	}
	return len(p), nil
}

// timedFlush writes a tail that waited flushAfter.
func (h *History) timedFlush() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.timer = nil
	if !h.closed {
		_ = h.flushLocked() // an error shows again on the next write
	}
}

// Flush writes the tail to the file now: a stop writes what the job wrote
// so far to disk at once, as the container may be killed before the tail's
// timer or Close would have.
func (h *History) Flush() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil
	}
	return h.flushNowLocked()
}

// flushNowLocked disarms the tail's timer and writes the tail to the file.
func (h *History) flushNowLocked() error {
	if h.timer != nil {
		h.timer.Stop()
		h.timer = nil
	}
	if err := h.flushLocked(); err != nil {
		return fmt.Errorf("write job log: %w", err)
	}
	return nil
}

// Close marks the end of output; readers finish once they caught up.
func (h *History) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil
	}
	h.closed = true
	close(h.changed)
	return errors.Join(h.flushNowLocked(), h.f.Sync())
}

// Size returns the bytes written so far.
func (h *History) Size() int64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.size
}

// Reader returns a reader of the history from the first output written in
// or after the second of since (zero: from the start).
func (h *History) Reader(since time.Time) *HistoryReader {
	h.mu.Lock()
	defer h.mu.Unlock()
	off := int64(0)
	if !since.IsZero() {
		s := since.Unix()
		i := sort.Search(len(h.secs), func(i int) bool { return h.secs[i] >= s })
		if i < len(h.secs) {
			off = h.offs[i]
		} else {
			off = h.size
		}
	}
	return &HistoryReader{h: h, off: off, until: -1}
}

// ReaderSoFar is Reader that ends (io.EOF) where the output written so far
// ends, instead of following it.
func (h *History) ReaderSoFar(since time.Time) *HistoryReader {
	r := h.Reader(since)
	r.until = h.Size()
	return r
}

// HistoryReader follows the history.
type HistoryReader struct {
	h     *History
	off   int64
	until int64 // where the reader ends; -1: it follows until Close
}

// Next blocks until output is available and returns up to max bytes of it;
// io.EOF once the history is closed and everything was read.
func (r *HistoryReader) Next(ctx context.Context, max int) ([]byte, error) {
	for {
		if r.until >= 0 {
			if r.off >= r.until {
				return nil, io.EOF
			}
			max = int(min(int64(max), r.until-r.off))
		}
		r.h.mu.Lock()
		size, closed, changed, f := r.h.size, r.h.closed, r.h.changed, r.h.f
		if r.off >= size && !closed {
			r.h.handed = true // this reader will wait on changed
		}
		inFile := size - int64(len(r.h.tail))
		if r.off >= inFile && r.off < size { // in the tail: copy under the lock
			n := min(size-r.off, int64(max))
			start := r.off - inFile
			buf := append([]byte(nil), r.h.tail[start:start+n]...)
			r.h.mu.Unlock()
			r.off += n
			return buf, nil
		}
		head, dropEnd, keep := r.h.trim.r.Head, r.h.trim.dropEnd, r.h.trim.r.Max
		r.h.mu.Unlock()
		if dropEnd > head && r.off >= head && r.off < dropEnd { // in the hole
			end := dropEnd
			if r.until >= 0 {
				end = min(end, r.until)
			}
			skipped := end - r.off
			r.off = end
			return droppedMarker(skipped, head, keep), nil
		}
		if r.off < size { // in the file: read outside the lock
			n := min(inFile-r.off, int64(max))
			if r.off < head {
				n = min(n, head-r.off) // the head ends where a hole may start
			}
			buf := make([]byte, n)
			m, err := f.ReadAt(buf, r.off)
			if err != nil && !errors.Is(err, io.EOF) {
				return nil, fmt.Errorf("read job log: %w", err)
			}
			// A hole punched while we read reads as zeros: read again.
			r.h.mu.Lock()
			raced := r.h.trim.dropEnd > r.off && r.off >= r.h.trim.r.Head
			r.h.mu.Unlock()
			if raced {
				continue
			}
			r.off += int64(m)
			return buf[:m], nil
		}
		if closed {
			return nil, io.EOF
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// droppedMarker tells a reader, in the stream, where output was dropped.
func droppedMarker(skipped, head, keep int64) []byte {
	return fmt.Appendf(nil, "\r\n[tandem: %d bytes of output were dropped here to bound the job's log on disk: it keeps the first %d and the latest %d bytes]\r\n",
		skipped, head, keep-head)
}
