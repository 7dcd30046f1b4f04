package testenv

import (
	"net"
	"sync"
	"testing"
	"time"
)

// DelayRelay is a TCP relay on loopback that holds every byte for a fixed
// time in each direction: a long link (a WAN's round trip) with no
// bandwidth limit of its own, for a machine whose kernel has no netem.
// What bounds a stream through it is the flow control of the protocol it
// carries (an SSH channel's window) over the round trip. TCP's own window
// does not: the relay reads at once (over a real link Linux auto-tunes it
// to several MiB, above an SSH channel's 2).
type DelayRelay struct {
	Addr string // 127.0.0.1:port, to dial instead of the target

	ln     net.Listener
	target string
	oneWay time.Duration
	wg     sync.WaitGroup
	mu     sync.Mutex // guards conns and closed
	conns  map[net.Conn]struct{}
	closed bool
}

// maxHeldChunks bounds the chunks one direction holds in flight (each at
// most relayChunk bytes: 512 MiB), so a reader far ahead of its writer
// waits, as a sender does when a link's queue is full.
const (
	relayChunk    = 64 << 10
	maxHeldChunks = 8192
)

// StartDelayRelay relays 127.0.0.1:<free port> to target, each direction
// delayed by rtt/2; it stops with the test, closing what it relays.
func StartDelayRelay(t testing.TB, target string, rtt time.Duration) *DelayRelay {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &DelayRelay{Addr: ln.Addr().String(), ln: ln, target: target, oneWay: rtt / 2, conns: map[net.Conn]struct{}{}}
	r.wg.Add(1)
	go r.accept()
	t.Cleanup(r.close)
	return r
}

func (r *DelayRelay) close() {
	_ = r.ln.Close()
	r.mu.Lock()
	r.closed = true
	for c := range r.conns {
		_ = c.Close()
	}
	r.mu.Unlock()
	r.wg.Wait()
}

// track records c so that close can end it, until the returned func
// closes it; once the relay is closing, c is closed at once.
func (r *DelayRelay) track(c net.Conn) (done func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		_ = c.Close()
	}
	r.conns[c] = struct{}{}
	return func() {
		r.mu.Lock()
		delete(r.conns, c)
		r.mu.Unlock()
		_ = c.Close()
	}
}

func (r *DelayRelay) accept() {
	defer r.wg.Done()
	for {
		c, err := r.ln.Accept()
		if err != nil {
			return
		}
		done := r.track(c)
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			defer done()
			// The connect itself crosses the link: one way there, one back.
			time.Sleep(2 * r.oneWay)
			up, err := net.Dial("tcp", r.target)
			if err != nil {
				return
			}
			defer r.track(up)()
			var pumps sync.WaitGroup
			pumps.Add(2)
			go func() { defer pumps.Done(); r.pump(up, c) }()
			go func() { defer pumps.Done(); r.pump(c, up) }()
			pumps.Wait()
		}()
	}
}

type heldChunk struct {
	b   []byte
	due time.Time
}

// pump carries src to dst, each chunk written oneWay after it was read;
// src's end reaches dst as a half-close once everything before it did.
func (r *DelayRelay) pump(dst, src net.Conn) {
	held := make(chan heldChunk, maxHeldChunks)
	go func() {
		defer close(held)
		b := make([]byte, relayChunk)
		for {
			n, err := src.Read(b)
			if n > 0 { // held at its own size: most reads are small
				held <- heldChunk{append([]byte(nil), b[:n]...), time.Now().Add(r.oneWay)}
			}
			if err != nil {
				return
			}
		}
	}()
	for c := range held {
		time.Sleep(time.Until(c.due))
		if _, err := dst.Write(c.b); err != nil {
			_ = src.Close() // the reader ends; held drains unwritten
			for range held {
			}
			return
		}
	}
	if cw, ok := dst.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
}
