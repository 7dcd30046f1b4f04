package transport

import (
	"net"
	"sync"
)

// watched is a connection that cannot be peeked (an SSH tunnel's channel)
// read by one goroutine for its whole life, so that what arrives while it
// sits in the pool shows there: the agent's close (end of stream, an
// error) or stray bytes, as a non-blocking peek shows them on a socket.
// Without it, a call that may not be sent twice (a POST) could not be
// trusted to a kept channel and opened a new one: over a 100 ms link, a
// round trip more for every POST of a run.
//
// The reader holds at most watchAhead bytes not yet taken and then waits:
// a slow consumer holds the agent back as a socket's buffer would.
// Deadlines are the wrapped connection's (ctl's tunnel closes the channel
// when one passes, which ends the reader and every wait with its error).
type watched struct {
	net.Conn

	mu   sync.Mutex
	cond *sync.Cond
	buf  []byte // read, not yet taken
	// err is how the connection ended (the reader's error, or
	// net.ErrClosed from Close, whichever came first); nil while open.
	err error
}

// watchAhead bounds what the reader holds before a Read takes it.
const watchAhead = 64 << 10

func watch(c net.Conn) *watched {
	w := &watched{Conn: c}
	w.cond = sync.NewCond(&w.mu)
	go w.readLoop()
	return w
}

func (w *watched) readLoop() {
	chunk := make([]byte, 16<<10)
	for {
		w.mu.Lock()
		for len(w.buf) >= watchAhead && w.err == nil {
			w.cond.Wait()
		}
		stop := w.err != nil
		w.mu.Unlock()
		if stop {
			return
		}
		n, err := w.Conn.Read(chunk)
		w.mu.Lock()
		w.buf = append(w.buf, chunk[:n]...)
		if err != nil && w.err == nil {
			w.err = err
		}
		w.cond.Broadcast()
		w.mu.Unlock()
		if err != nil {
			return
		}
	}
}

// Read waits for bytes or the reader's end.
func (w *watched) Read(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for len(w.buf) == 0 && w.err == nil {
		w.cond.Wait()
	}
	return w.takeLocked(p)
}

// readNow is Read without the wait: errWouldWait when nothing is held.
func (w *watched) readNow(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.buf) == 0 && w.err == nil {
		return 0, errWouldWait
	}
	return w.takeLocked(p)
}

func (w *watched) takeLocked(p []byte) (int, error) {
	if len(w.buf) > 0 {
		n := copy(p, w.buf)
		w.buf = w.buf[n:]
		if len(w.buf) == 0 {
			w.buf = nil // the backing array goes with the last bytes
		}
		w.cond.Broadcast() // room for the reader
		return n, nil
	}
	return 0, w.err
}

// quiet says nothing has arrived and the reader has not ended: the only
// healthy state of an idle connection.
func (w *watched) quiet() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.buf) == 0 && w.err == nil
}

// Close closes the connection and ends every wait.
func (w *watched) Close() error {
	w.mu.Lock()
	if w.err == nil {
		w.err = net.ErrClosed
	}
	w.cond.Broadcast()
	w.mu.Unlock()
	return w.Conn.Close()
}
