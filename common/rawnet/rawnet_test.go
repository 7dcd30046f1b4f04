package rawnet

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// tcpPair returns both ends of a loopback TCP connection.
func tcpPair(t *testing.T) (*net.TCPConn, *net.TCPConn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		accepted <- c
	}()
	d, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	a := <-accepted
	if a == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { d.Close(); a.Close() })
	return d.(*net.TCPConn), a.(*net.TCPConn)
}

// randomBytes returns n pseudo-random bytes, the same for the same seed.
func randomBytes(n int, seed uint64) []byte {
	rng := rand.New(rand.NewPCG(seed, 1))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	return b
}

// sendInPieces writes want to w in writes of 1 to most bytes (sizes drawn
// from seed), then half-closes w; the outcome comes on the channel.
func sendInPieces(w net.Conn, want []byte, most int, seed uint64) <-chan error {
	werr := make(chan error, 1)
	rng := rand.New(rand.NewPCG(seed, 2))
	go func() {
		for rest := want; len(rest) > 0; {
			n := min(1+rng.IntN(most), len(rest))
			m, err := w.Write(rest[:n])
			if err != nil || m != n {
				werr <- errors.Join(err, errors.New("short write"))
				return
			}
			rest = rest[n:]
		}
		werr <- w.(*Conn).CloseWrite()
	}()
	return werr
}

// TestStreamWithSmallBuffers moves 8 MiB through socket buffers far
// smaller than it (so writes meet EAGAIN and wait on the poller) in
// random-sized writes and reads, with and without read-ahead.
func TestStreamWithSmallBuffers(t *testing.T) {
	for _, ahead := range []bool{false, true} {
		d, a := tcpPair(t)
		_ = d.SetWriteBuffer(64 << 10)
		_ = a.SetReadBuffer(64 << 10)
		w := Wrap(d)
		r := Wrap(a)
		if ahead {
			r = WrapBuffered(a, NewBuffers(1500, 1), nil)
		}
		want := randomBytes(8<<20, 1)
		werr := sendInPieces(w, want, 300<<10, 2)
		var got bytes.Buffer
		buf := make([]byte, 64<<10)
		rr := rand.New(rand.NewPCG(3, 4))
		for {
			n, err := r.Read(buf[:1+rr.IntN(len(buf))])
			got.Write(buf[:n])
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
		}
		if err := <-werr; err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got.Bytes(), want) {
			t.Fatalf("ahead=%v: got %d bytes, not what was sent (%d)", ahead, got.Len(), len(want))
		}
	}
}

// TestHalfCloseOverUnixSocket: CloseWrite is an EOF at the peer, which can
// still answer.
func TestHalfCloseOverUnixSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		c = Wrap(c)
		defer c.Close()
		in, _ := io.ReadAll(c)
		_, _ = c.Write(append([]byte("got "), in...))
	}()
	raw, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	c := Wrap(raw)
	defer c.Close()
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	if err := c.(*Conn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	ans, err := io.ReadAll(c)
	if err != nil || string(ans) != "got ping" {
		t.Fatalf("answer %q, %v", ans, err)
	}
}

// TestDeadlinesAndClose: a deadline ends a waiting Read or Write with a
// timeout error, and Close ends a waiting Read with net.ErrClosed.
func TestDeadlinesAndClose(t *testing.T) {
	for _, ahead := range []bool{false, true} {
		d, a := tcpPair(t)
		_ = d.SetWriteBuffer(64 << 10)
		_ = a.SetReadBuffer(64 << 10)
		w, r := Wrap(d), Wrap(a)
		if ahead {
			r = WrapBuffered(a, NewBuffers(1024, 1), nil)
		}
		_ = r.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		_, err := r.Read(make([]byte, 10))
		var ne net.Error
		if !errors.As(err, &ne) || !ne.Timeout() || !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("ahead=%v: read past its deadline: %v", ahead, err)
		}
		_ = w.SetWriteDeadline(time.Now().Add(200 * time.Millisecond))
		n, err := w.Write(make([]byte, 64<<20)) // nobody reads
		if !errors.As(err, &ne) || !ne.Timeout() || n >= 64<<20 {
			t.Fatalf("ahead=%v: write past its deadline: %d, %v", ahead, n, err)
		}

		_ = r.SetReadDeadline(time.Time{})
		_, _ = io.CopyN(io.Discard, r, int64(n)) // what the write got through
		done := make(chan error, 1)
		go func() {
			_, err := r.Read(make([]byte, 10))
			done <- err
		}()
		time.Sleep(30 * time.Millisecond)
		r.Close()
		select {
		case err := <-done:
			if !errors.Is(err, net.ErrClosed) {
				t.Fatalf("ahead=%v: read after close: %v", ahead, err)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("ahead=%v: close did not end the waiting read", ahead)
		}
	}
}

// TestResetIsAnError: a reset connection reads as ECONNRESET, not EOF.
func TestResetIsAnError(t *testing.T) {
	d, a := tcpPair(t)
	r := Wrap(a)
	if _, err := d.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	_ = d.SetLinger(0)
	d.Close()
	time.Sleep(20 * time.Millisecond)
	var err error
	for i := 0; i < 3 && err == nil; i++ { // the byte may still come first
		_, err = r.Read(make([]byte, 10))
	}
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("read of a reset connection: %v", err)
	}
	var oe *net.OpError
	if !errors.As(err, &oe) || oe.Op != "read" {
		t.Fatalf("error %v is not a read OpError", err)
	}
}

// TestReadAheadBuffersBounded: read-ahead buffers are held only while they
// hold unread data (not by a connection waiting for data), are bounded (a
// connection finding none reads straight into the caller's buffer), and
// come back when drained or when the connection closes with data unread.
func TestReadAheadBuffersBounded(t *testing.T) {
	bufs := NewBuffers(1024, 1)
	free := func() int {
		bufs.mu.Lock()
		defer bufs.mu.Unlock()
		return len(bufs.free) + cap(bufs.free) - bufs.made
	}
	d1, a1 := tcpPair(t)
	d2, a2 := tcpPair(t)
	c1, c2 := WrapBuffered(a1, bufs, nil), WrapBuffered(a2, bufs, nil)

	// A Read waiting for data holds no buffer.
	got := make(chan []byte, 1)
	go func() {
		p := make([]byte, 10)
		n, _ := c1.Read(p)
		got <- p[:n]
	}()
	time.Sleep(50 * time.Millisecond)
	if free() != 1 {
		t.Fatalf("a waiting read holds a buffer: %d free", free())
	}
	msg := bytes.Repeat([]byte("0123456789"), 300)
	if _, err := d1.Write(msg); err != nil {
		t.Fatal(err)
	}
	if p := <-got; !bytes.Equal(p, msg[:10]) {
		t.Fatalf("first read %q", p)
	}
	if free() != 0 {
		t.Fatal("c1 read ahead without a buffer")
	}
	// None left: c2 reads straight into the caller's buffer.
	if _, err := d2.Write(msg); err != nil {
		t.Fatal(err)
	}
	p := make([]byte, 10)
	if n, err := io.ReadFull(c2, p); err != nil || n != 10 || !bytes.Equal(p, msg[:10]) || free() != 0 {
		t.Fatalf("c2 read %q, %v; %d free", p[:n], err, free())
	}
	// c1 drains its buffer (1024 bytes were read ahead): it comes back.
	rest := make([]byte, 1014)
	if _, err := io.ReadFull(c1, rest); err != nil || !bytes.Equal(rest, msg[10:1024]) {
		t.Fatalf("drain: %v", err)
	}
	if free() != 1 {
		t.Fatalf("drained buffer not given back: %d free", free())
	}
	// c2 takes it, and closing with data unread gives it back.
	if _, err := io.ReadFull(c2, p); err != nil || !bytes.Equal(p, msg[10:20]) || free() != 0 {
		t.Fatalf("c2 second read %q, %v, %d free", p, err, free())
	}
	c2.Close()
	if free() != 1 {
		t.Fatalf("close did not give the buffer back: %d free", free())
	}
	// A read bigger than a buffer goes straight through.
	big := make([]byte, 2000)
	if n, err := c1.Read(big); err != nil || !bytes.Equal(big[:n], msg[1024:1024+n]) || free() != 1 {
		t.Fatalf("big read %d, %v, %d free", n, err, free())
	}
}

// TestWrapWithoutDescriptor: a connection with no descriptor, or with a
// blocking one, is left as it is.
func TestWrapWithoutDescriptor(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if Wrap(a) != a || WrapBuffered(b, NewBuffers(10, 1), nil) != b {
		t.Fatal("a pipe was wrapped")
	}
	d, blocking := tcpPair(t)
	w := Wrap(d)
	if Wrap(w) != w {
		t.Fatal("wrapped twice")
	}
	// A blocking descriptor is left to the net package's calls.
	rc, _ := blocking.SyscallConn()
	_ = rc.Control(func(fd uintptr) { _ = syscall.SetNonblock(int(fd), false) })
	if Wrap(blocking) != net.Conn(blocking) {
		t.Fatal("a blocking socket was wrapped")
	}
}

// TestBuffersBound: at most max buffers are made, Get answers nil past
// them, and given-back ones are reused.
func TestBuffersBound(t *testing.T) {
	b := NewBuffers(64, 2)
	x, y := b.Get(), b.Get()
	if len(x) != 64 || len(y) != 64 {
		t.Fatalf("sizes %d %d", len(x), len(y))
	}
	if b.Get() != nil {
		t.Fatal("a third buffer past a bound of two")
	}
	b.Put(x)
	if again := b.Get(); &again[0] != &x[0] {
		t.Fatal("a given-back buffer is not reused")
	}
	b.Put(x)
	b.Put(y)
	b.Put(make([]byte, 10)) // foreign: ignored
	b.Put(nil)
	if b.made != 2 || len(b.free) != 2 {
		t.Fatalf("made %d, free %d", b.made, len(b.free))
	}
}

// quickAckOn reads TCP_QUICKACK: 1 while the kernel acknowledges at once,
// 0 while it delays acknowledgements for a reply to carry them.
func quickAckOn(t *testing.T, c *net.TCPConn) int {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var v int
	var gerr error
	if err := rc.Control(func(fd uintptr) {
		v, gerr = unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_QUICKACK)
	}); err != nil {
		t.Fatal(err)
	}
	if gerr != nil {
		t.Fatal(gerr)
	}
	return v
}

// TestQuickAckEndsDelayedAcks: a socket the kernel has in its delayed
// acknowledgement mode (what a request/response exchange such as an SSH
// key exchange puts it in) acknowledges at once after QuickAck, so a
// client holding a small packet behind its last one (Nagle) sends it now
// rather than after the 40 ms delayed-ACK timer.
func TestQuickAckEndsDelayedAcks(t *testing.T) {
	client, server := tcpPair(t)
	rc, err := server.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.Control(func(fd uintptr) {
		err = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_QUICKACK, 0) // into delayed mode
	}); err != nil || quickAckOn(t, server) != 0 {
		t.Fatalf("could not put the socket in delayed-ACK mode: %v", err)
	}
	c, ok := Wrap(server).(*Conn)
	if !ok {
		t.Fatal("a TCP connection was not wrapped")
	}
	if _, err := client.Write([]byte("KEXINIT")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 16)
	if _, err := c.Read(buf); err != nil {
		t.Fatal(err)
	}
	c.QuickAck()
	if got := quickAckOn(t, server); got != 1 {
		t.Fatalf("TCP_QUICKACK after QuickAck = %d, want 1", got)
	}
}
