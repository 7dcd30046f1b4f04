// Package rawnet reads and writes sockets without handing the Go
// scheduler's P away during the system call: the runner's SSH connections
// and both agents' HTTP APIs (httpapi.Gate) use it.
//
// The net package enters every read and write through the runtime's
// syscall gate: a P whose goroutine sits in a system call longer than the
// monitor's tick (20 µs while busy) is taken and handed to another thread.
// A socket is non-blocking, so a read or write never sleeps in the kernel,
// but copying 256 KiB into a loopback socket takes longer than the tick:
// with one P (the runner's default on small machines) nearly every bulk
// write of a forward cost a hand-off and a thread wake-up, which OpenSSH's
// single-threaded loop never pays. A raw system call keeps the P, as the
// call cannot block; when the socket has no data or no room the goroutine
// waits on the runtime's poller exactly as net.Conn does (deadlines and
// Close included, through syscall.RawConn).
//
// WrapBuffered adds what the SSH server wants on top: reads that take up to
// a buffer's worth per system call (read-ahead) and writes that queue bulk
// data for one goroutine to write in batches (write-behind), each from a
// bounded set of shared buffers held only while they hold data.
package rawnet

import (
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Conn is a net.Conn whose Read and Write are raw system calls on the
// descriptor; every other method is the wrapped connection's.
type Conn struct {
	net.Conn
	rc syscall.RawConn

	ahead  *Buffers   // nil: no read-ahead
	behind *behind    // nil: writes go straight to the socket
	mu     sync.Mutex // serializes read-ahead Reads; guards buf, r, w
	buf    []byte     // read ahead; non-nil exactly while r < w
	r, w   int        // buf[r:w] is unread
}

// Wrap returns c with raw reads and writes, or c itself when it has no
// descriptor to use (a pipe, a TLS connection) or a blocking one: a raw
// call that sleeps in the kernel would hold the P (with one P, the whole
// process) until it returns. The net package's sockets are non-blocking;
// the check is for anything else.
func Wrap(c net.Conn) net.Conn {
	if _, ok := c.(*Conn); ok {
		return c
	}
	sc, ok := c.(syscall.Conn)
	if !ok {
		return c
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return c
	}
	nonblocking := false
	if err := rc.Control(func(fd uintptr) {
		flags, err := unix.FcntlInt(fd, unix.F_GETFL, 0)
		nonblocking = err == nil && flags&unix.O_NONBLOCK != 0
	}); err != nil || !nonblocking {
		return c
	}
	return &Conn{Conn: c, rc: rc}
}

// WrapBuffered is Wrap with buffered reads (ahead; none when nil) and
// writes (behind; straight to the socket when nil), each buffer taken from
// its bounded set only while it holds data.
//
// Read-ahead: small reads are served from a buffer filled by one system
// call, so a reader that takes a header and then a body through a small
// bufio (as x/crypto/ssh does, 4 KiB) makes one system call per many
// packets instead of two per packet.
//
// Write-behind: a Write copies into a buffer and returns, and a goroutine
// writes what queued up while the socket took the last batch in one system
// call. A sender that writes a packet per call (x/crypto/ssh writes and
// flushes each 32 KiB packet of a channel) then costs one system call per
// batch (up to behind's buffer size) instead of one per packet; a small
// write to an idle connection goes straight out. A Write waits only while
// the connection's batch is full; when every shared buffer is in use it
// waits for its queue to empty and writes directly. A failed batch fails
// every later Write (the bytes queued with it are lost, as in a socket's
// own buffer when the connection breaks); Close first waits, at most
// closeFlushWait, for what is queued to go out.
func WrapBuffered(c net.Conn, ahead, behind *Buffers) net.Conn {
	w := Wrap(c)
	if rc, ok := w.(*Conn); ok {
		rc.ahead = ahead
		if behind != nil {
			rc.behind = newBehind(behind)
		}
	}
	return w
}

// Read reads what the socket holds, up to len(p); it waits on the poller
// while it holds nothing.
func (c *Conn) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	if c.ahead == nil {
		return c.read(p)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.r < c.w {
		return c.drain(p), nil
	}
	if len(p) >= c.ahead.size {
		return c.read(p)
	}
	// Wait for data holding no buffer: an idle connection holds none.
	var n int
	var errno syscall.Errno
	err := c.rc.Read(func(fd uintptr) bool {
		dst := c.ahead.Get()
		own := dst != nil
		if !own { // all in use: straight into p
			dst = p
		}
		n, errno = RawRead(fd, dst)
		switch {
		case errno == syscall.EAGAIN:
			if own {
				c.ahead.Put(dst)
			}
			return false
		case own && n > 0:
			c.buf = dst
		case own:
			c.ahead.Put(dst)
		}
		return true
	})
	if c.buf == nil { // an error, the end, or read straight into p
		return c.readResult(n, err, errno)
	}
	c.r, c.w = 0, n
	return c.drain(p), nil
}

// drain copies read-ahead data into p and gives the buffer back once it
// is empty.
func (c *Conn) drain(p []byte) int {
	n := copy(p, c.buf[c.r:c.w])
	c.r += n
	if c.r == c.w {
		c.ahead.Put(c.buf)
		c.buf = nil
	}
	return n
}

func (c *Conn) read(p []byte) (int, error) {
	var n int
	var errno syscall.Errno
	err := c.rc.Read(func(fd uintptr) bool {
		n, errno = RawRead(fd, p)
		return errno != syscall.EAGAIN
	})
	return c.readResult(n, err, errno)
}

// readResult is Read's answer to a raw read's outcome.
func (c *Conn) readResult(n int, err error, errno syscall.Errno) (int, error) {
	switch {
	case err != nil:
		return 0, c.opError("read", err)
	case errno != 0:
		return 0, c.opError("read", os.NewSyscallError("read", errno))
	case n == 0:
		return 0, io.EOF
	}
	return n, nil
}

// RawRead is one read(2) of fd into p (len(p) > 0), retried on EINTR,
// that keeps the P: fd is non-blocking (a socket here; the runner's pty
// reader too, once the terminal says it holds input).
func RawRead(fd uintptr, p []byte) (int, syscall.Errno) {
	for {
		r, _, e := syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
		if e != syscall.EINTR {
			if e != 0 {
				return 0, e
			}
			return int(r), 0
		}
	}
}

// QuickAck makes the kernel acknowledge what c's socket received at once
// (TCP_QUICKACK) instead of holding the acknowledgement up to 40 ms for a
// reply to carry it. The setting does not last: Linux goes back to delayed
// acknowledgements once the socket answers quickly, so a caller sets it
// after each read where it matters. A client with Nagle's algorithm on
// (OpenSSH's ssh before its session is interactive) holds a small packet
// written behind an unacknowledged one until that acknowledgement comes:
// twice in an SSH key exchange (KEXINIT then ECDH_INIT; NEWKEYS then the
// service request), 80 ms of every login on Linux. On anything but a TCP
// socket the kernel refuses the option, and that is ignored: the call is
// advisory.
func (c *Conn) QuickAck() {
	_ = c.rc.Control(func(fd uintptr) {
		_ = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_QUICKACK, 1)
	})
}

// Buffers is a bounded set of same-sized buffers shared by connections
// (read-ahead here, the forwards' burst buffers in sshd): a user that
// finds none free goes on without one (for read-ahead: reads straight into
// the caller's buffer).
type Buffers struct {
	size int
	free chan []byte
	mu   sync.Mutex // guards made
	made int
}

// NewBuffers bounds the set to max buffers of size bytes, made on demand.
func NewBuffers(size, max int) *Buffers {
	return &Buffers{size: size, free: make(chan []byte, max)}
}

// Get returns a free buffer, or nil when all max are in use.
func (b *Buffers) Get() []byte {
	select {
	case buf := <-b.free:
		return buf
	default:
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.made == cap(b.free) {
		return nil
	}
	b.made++
	return make([]byte, b.size)
}

// Put gives back a buffer from Get; nil and foreign buffers are ignored.
func (b *Buffers) Put(buf []byte) {
	if len(buf) != b.size {
		return
	}
	b.free <- buf
}

// Write writes all of p, waiting on the poller while the socket has no
// room; with write-behind (WrapBuffered) it may return once p is queued.
func (c *Conn) Write(p []byte) (int, error) {
	if c.behind != nil {
		return c.writeBehind(p)
	}
	return c.writeNow(p)
}

// writeNow writes all of p to the socket before it returns.
func (c *Conn) writeNow(p []byte) (int, error) {
	var n int
	var errno syscall.Errno
	err := c.rc.Write(func(fd uintptr) bool {
		for n < len(p) {
			r, _, e := syscall.RawSyscall(syscall.SYS_WRITE, fd, uintptr(unsafe.Pointer(&p[n])), uintptr(len(p)-n))
			switch e {
			case 0:
				n += int(r)
			case syscall.EINTR:
			case syscall.EAGAIN:
				return false
			default:
				errno = e
				return true
			}
		}
		return true
	})
	switch {
	case err != nil:
		return n, c.opError("write", err)
	case errno != 0:
		return n, c.opError("write", os.NewSyscallError("write", errno))
	}
	return n, nil
}

// Close closes the connection and gives back a read-ahead buffer it still
// held (a connection closed with data unread).
func (c *Conn) Close() error {
	if c.behind != nil {
		_ = c.drainBehind(true)
	}
	err := c.Conn.Close()
	if c.ahead != nil {
		c.mu.Lock() // a Read waiting on the poller holds no buffer and returns now
		if c.buf != nil {
			c.ahead.Put(c.buf)
			c.buf, c.r, c.w = nil, 0, 0
		}
		c.mu.Unlock()
	}
	return err
}

// CloseWrite shuts the write side down when the wrapped connection can
// (TCP, Unix stream): a forward passes a half-close on with it. What was
// written behind goes out first.
func (c *Conn) CloseWrite() error {
	cw, ok := c.Conn.(interface{ CloseWrite() error })
	if !ok {
		return c.opError("close-write", syscall.ENOTSUP)
	}
	if c.behind != nil {
		if err := c.drainBehind(false); err != nil {
			return err
		}
	}
	return cw.CloseWrite()
}

// opError names the operation and the endpoints as net.Conn's errors do
// (a deadline error stays a net.Error whose Timeout is true).
func (c *Conn) opError(op string, err error) error {
	if oe, ok := err.(*net.OpError); ok {
		oe.Op = op
		return oe
	}
	return &net.OpError{Op: op, Net: c.LocalAddr().Network(), Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: err}
}
