package rawnet

import (
	"sync"
	"time"
)

// behind is a connection's write-behind queue (see WrapBuffered): Write
// copies into fill and returns; one flushing goroutine per busy spell
// writes what queued up, a buffer at a time, so packets written while the
// socket took the last batch go out together in one system call.
type behind struct {
	bufs *Buffers
	wmu  sync.Mutex // serializes Writes: each one's bytes stay contiguous
	mu   sync.Mutex // guards the rest
	cond *sync.Cond // signalled when fill is taken, the flusher stops, or it fails
	fill []byte     // queued, not yet taken by the flusher (nil: none held)
	busy bool       // a flusher runs; set whenever fill holds data
	err  error      // the flusher's write failed: every later Write fails
	// closeWait bounds how long Close waits for queued data to go out.
	closeWait time.Duration
}

// directWrite: a Write smaller than this to an idle connection goes
// straight to the socket. Batching pays for bulk data (x/crypto/ssh's
// 32 KiB packets); a lone small packet (a keystroke's echo, an upload's
// window adjust) has nothing to share its system call with, and behind it
// would only wait for the writer to yield to a flusher it had to start.
const directWrite = 16 << 10

// closeFlushWait is how long Close waits for queued data to go out.
const closeFlushWait = 2 * time.Second

func newBehind(bufs *Buffers) *behind {
	b := &behind{bufs: bufs, closeWait: closeFlushWait}
	b.cond = sync.NewCond(&b.mu)
	return b
}

// writeBehind queues p for the flusher. It waits only while the
// connection's buffer is full (the socket has not taken the last batch)
// or, with every shared buffer in use, for the flusher to finish so that
// it can write p itself in order.
func (c *Conn) writeBehind(p []byte) (int, error) {
	b := c.behind
	b.wmu.Lock()
	defer b.wmu.Unlock()
	written := 0
	b.mu.Lock()
	if !b.busy && b.err == nil && len(p) < directWrite {
		// An idle connection and a small write (a keystroke's echo, a
		// window adjust): straight out, no hand-off.
		b.mu.Unlock()
		return c.writeNow(p)
	}
	for len(p) > 0 {
		for b.err == nil && b.fill != nil && len(b.fill) == cap(b.fill) {
			b.cond.Wait()
		}
		if b.err != nil {
			err := b.err
			b.mu.Unlock()
			return written, err
		}
		if b.fill == nil {
			if buf := b.bufs.Get(); buf != nil {
				b.fill = buf[:0]
			} else {
				// No buffer free: once the flusher is done, write
				// directly (writers are serialized, so order holds).
				for b.busy && b.err == nil {
					b.cond.Wait()
				}
				if b.err != nil {
					continue
				}
				b.mu.Unlock()
				n, err := c.writeNow(p)
				return written + n, err
			}
		}
		m := copy(b.fill[len(b.fill):cap(b.fill)], p)
		b.fill = b.fill[:len(b.fill)+m]
		p = p[m:]
		written += m
		if !b.busy {
			b.busy = true
			go c.flush()
		}
	}
	b.mu.Unlock()
	return written, nil
}

// flush writes queued batches until none is left or a write fails.
func (c *Conn) flush() {
	b := c.behind
	for {
		b.mu.Lock()
		out := b.fill
		b.fill = nil
		if len(out) == 0 {
			b.busy = false
			b.cond.Broadcast()
			b.mu.Unlock()
			b.bufs.Put(out[:cap(out)])
			return
		}
		b.cond.Broadcast() // room for writers waiting on a full buffer
		b.mu.Unlock()
		_, err := c.writeNow(out)
		b.bufs.Put(out[:cap(out)])
		if err != nil {
			b.mu.Lock()
			b.err = err
			b.busy = false
			if b.fill != nil {
				b.bufs.Put(b.fill[:cap(b.fill)])
				b.fill = nil
			}
			b.cond.Broadcast()
			b.mu.Unlock()
			return
		}
	}
}

// drainBehind waits until queued data went out (or failed to) and returns
// the flusher's error. bounded (for Close) cuts the wait to closeWait by a
// write deadline; otherwise it lasts as a direct write would (the
// connection's own deadline bounds it, if any).
func (c *Conn) drainBehind(bounded bool) error {
	b := c.behind
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.busy && bounded {
		_ = c.Conn.SetWriteDeadline(time.Now().Add(b.closeWait))
	}
	for b.busy {
		b.cond.Wait()
	}
	return b.err
}
