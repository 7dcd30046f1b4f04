package transport

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// lean carries an agent's calls on kept-alive connections, each call wholly
// in its caller's goroutine: the request written, the answer read, and the
// connection back in the pool once its body was read to the end. net/http's
// Transport hands every call between three goroutines (the caller, a
// writer and a reader per connection); on two busy cores those hand-offs
// cost a poller 2.4 times the shim's own CPU per GET (BenchmarkShimGetTask:
// client-cpu-us/get). Calls whose body is a stream (a code upload, which
// can be answered before it is all sent) go to net/http's Transport.
type lean struct {
	dial DialFunc
	// streams carries what lean does not: streamed bodies, other schemes.
	streams http.RoundTripper
	// maxIdle and idleFor bound the pool. Kept connections matter: every
	// new connection to a shim costs it a walk of the process table (who
	// is calling); with 4 kept, 64 pollers opened a connection per call
	// and GET p99 was 1.7 s, with 64 it was 0.28 s (BenchmarkShim64Tasks).
	// idleFor stays under the agents'
	// own keep-alive limits (the shim's 60 s), so a kept connection is
	// rarely one the agent already closed; a call that meets one anyway is
	// retried (below).
	maxIdle int
	idleFor time.Duration
	now     func() time.Time

	mu   sync.Mutex
	idle []*leanConn
}

type leanConn struct {
	c      net.Conn
	br     *bufio.Reader
	bw     *bufio.Writer
	got    int64     // bytes read from c during the current call
	idleAt time.Time // when it went back to the pool
	// noWait makes br's next fill fail instead of reading c: a body
	// closed early is drained of what already arrived, and no more.
	noWait bool
	// headLeft bounds what is read while an answer's head is (> 0);
	// headOver says the bound was met.
	headLeft int64
	headOver bool
}

var (
	errWouldWait = errors.New("the rest of the answer has not arrived")
	errHeadLarge = fmt.Errorf("the answer's head is larger than %d bytes: refused", maxHead)
)

// maxHead bounds an answer's status line and headers (net/http's
// Transport allows 10 MB): an agent's are a few hundred bytes.
const maxHead = 1 << 20

func (lc *leanConn) Read(p []byte) (int, error) {
	if lc.noWait {
		// Only what has arrived: on a watched channel, what its reader
		// holds.
		w, ok := lc.c.(*watched)
		if !ok {
			return 0, errWouldWait
		}
		n, err := w.readNow(p)
		lc.got += int64(n)
		return n, err
	}
	if lc.headLeft > 0 && int64(len(p)) > lc.headLeft {
		p = p[:lc.headLeft]
	}
	n, err := lc.c.Read(p)
	lc.got += int64(n)
	if lc.headLeft > 0 {
		if lc.headLeft -= int64(n); lc.headLeft == 0 && err == nil {
			lc.headOver, err = true, errHeadLarge
		}
	}
	return n, err
}

// longAgo is a deadline already past: it makes a blocked read or write on
// a connection return at once.
var longAgo = time.Unix(1, 0)

func newLean(dial DialFunc, streams http.RoundTripper) *lean {
	return &lean{dial: dial, streams: streams, maxIdle: 64, idleFor: 50 * time.Second, now: time.Now}
}

// replayable: the request's body can be sent again (none, or one that
// GetBody rewinds), so lean can carry it and retry it.
func replayable(req *http.Request) bool {
	return req.Body == nil || req.Body == http.NoBody || req.GetBody != nil
}

// idempotent: a call that may be sent twice without a second effect, as
// net/http decides which calls it retries on a connection found closed.
func idempotent(req *http.Request) bool {
	switch req.Method {
	case "", http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	return false
}

// RoundTrip implements http.RoundTripper.
func (t *lean) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Scheme != "http" || !replayable(req) {
		return t.streams.RoundTrip(req)
	}
	ctx := req.Context()
	for attempt := 0; ; attempt++ {
		lc, reused, err := t.conn(ctx, req, attempt > 0)
		if err != nil {
			return nil, err
		}
		if attempt > 0 && req.GetBody != nil {
			body, err := req.GetBody()
			if err != nil {
				lc.c.Close()
				return nil, fmt.Errorf("rewind the request body: %w", err)
			}
			req = req.Clone(ctx)
			req.Body = body
		}
		resp, err := t.exchange(ctx, lc, req)
		if err == nil {
			return resp, nil
		}
		// A kept connection the agent closed while it sat idle answers
		// nothing: the call is sent again, once, on a new connection when
		// sending it twice cannot do anything twice.
		if reused && lc.got == 0 && attempt == 0 && idempotent(req) && ctx.Err() == nil {
			continue
		}
		return nil, err
	}
}

// conn is a pooled connection still open, or a new one (always, when
// fresh: a retry does not meet the next connection the agent closed).
func (t *lean) conn(ctx context.Context, req *http.Request, fresh bool) (*leanConn, bool, error) {
	var stale []*leanConn
	defer func() {
		for _, lc := range stale {
			lc.c.Close()
		}
	}()
	now := t.now()
	t.mu.Lock()
	for len(t.idle) > 0 && !fresh {
		lc := t.idle[len(t.idle)-1]
		if now.Sub(lc.idleAt) > t.idleFor {
			t.idle = t.idle[:len(t.idle)-1]
			stale = append(stale, lc)
			continue
		}
		// A kept connection is checked for the agent's close before a
		// call goes on it: a channel always (its reader, watched, says
		// what came while it was idle, at no cost), a socket by one peek
		// without a wait for a call that may not be sent twice (a GET on
		// one the agent closed is sent again, below).
		if !alive(lc.c, idempotent(req)) {
			t.idle = t.idle[:len(t.idle)-1]
			stale = append(stale, lc)
			continue
		}
		t.idle = t.idle[:len(t.idle)-1]
		t.mu.Unlock()
		return lc, true, nil
	}
	t.mu.Unlock()
	addr := req.URL.Host
	if _, _, err := net.SplitHostPort(addr); err != nil {
		addr = net.JoinHostPort(req.URL.Hostname(), "80")
	}
	c, err := t.dial(ctx, "tcp", addr)
	if err != nil {
		return nil, false, mapErr(ctx, err)
	}
	if _, sock := c.(syscall.Conn); !sock {
		c = watch(c)
	}
	lc := &leanConn{c: c, bw: bufio.NewWriterSize(c, 4<<10)}
	lc.br = bufio.NewReaderSize(lc, 16<<10)
	return lc, false, nil
}

// alive says whether an idle connection is still fit for a call: a
// watched channel whose reader saw nothing arrive; a socket, when the
// call could be sent again anyway (a GET is retried on a connection that
// answers nothing) or a peek finds it open.
func alive(c net.Conn, idempotent bool) bool {
	if w, ok := c.(*watched); ok {
		return w.quiet()
	}
	if idempotent {
		return true
	}
	sc, ok := c.(syscall.Conn)
	return ok && open(sc)
}

// open reports whether the peer has not closed an idle socket: a
// non-blocking peek finds nothing to read.
func open(sc syscall.Conn) bool {
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	alive := false
	var b [1]byte
	err = rc.Read(func(fd uintptr) bool {
		_, _, rerr := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		// Nothing to read is the only healthy state of an idle
		// connection: end of stream, an error or stray bytes are not.
		alive = errors.Is(rerr, syscall.EAGAIN)
		return true
	})
	return err == nil && alive
}

// exchange sends req on lc and reads the answer's head; its body reads
// from lc and hands it back to the pool at its end.
func (t *lean) exchange(ctx context.Context, lc *leanConn, req *http.Request) (*http.Response, error) {
	lc.got = 0
	dl, _ := ctx.Deadline()
	if err := lc.c.SetDeadline(dl); err != nil {
		lc.c.Close()
		return nil, err
	}
	stop := context.AfterFunc(ctx, func() { _ = lc.c.SetDeadline(longAgo) })
	fail := func(err error) (*http.Response, error) {
		stop()
		lc.c.Close()
		return nil, mapErr(ctx, err)
	}
	if err := req.Write(lc.bw); err != nil {
		return fail(err)
	}
	if err := lc.bw.Flush(); err != nil {
		return fail(err)
	}
	for {
		lc.headLeft, lc.headOver = maxHead, false
		resp, err := http.ReadResponse(lc.br, req)
		lc.headLeft = 0
		if lc.headOver {
			// What the parser made of a head cut at the bound (a
			// malformed header, say) is not the reason.
			err = errHeadLarge
		}
		if err != nil {
			return fail(err)
		}
		// An interim answer (102, 103) is followed by the real one; 101
		// is not asked for on this path and ends the connection's use.
		if resp.StatusCode >= 100 && resp.StatusCode < 200 && resp.StatusCode != http.StatusSwitchingProtocols {
			continue
		}
		resp.Body = &leanBody{t: t, lc: lc, ctx: ctx, stop: stop, body: resp.Body,
			keep: !resp.Close && !req.Close && resp.StatusCode != http.StatusSwitchingProtocols}
		return resp, nil
	}
}

// put returns a connection whose call ended cleanly to the pool.
func (t *lean) put(lc *leanConn) {
	// Bytes past the answer's end are not the start of a next answer.
	if lc.br.Buffered() > 0 {
		lc.c.Close()
		return
	}
	if err := lc.c.SetDeadline(time.Time{}); err != nil {
		lc.c.Close()
		return
	}
	lc.idleAt = t.now()
	var spent []*leanConn
	t.mu.Lock()
	// The oldest are at the bottom: those past idleFor are let go here,
	// so a pool that is never drained down to them does not keep them.
	for len(t.idle) > 0 && lc.idleAt.Sub(t.idle[0].idleAt) > t.idleFor {
		spent = append(spent, t.idle[0])
		t.idle = t.idle[1:]
	}
	if len(t.idle) < t.maxIdle {
		t.idle = append(t.idle, lc)
	} else {
		spent = append(spent, lc)
	}
	t.mu.Unlock()
	for _, s := range spent {
		s.c.Close()
	}
}

// CloseIdleConnections closes the pooled connections (http.Client calls it).
func (t *lean) CloseIdleConnections() {
	t.mu.Lock()
	idle := t.idle
	t.idle = nil
	t.mu.Unlock()
	for _, lc := range idle {
		lc.c.Close()
	}
	if ci, ok := t.streams.(interface{ CloseIdleConnections() }); ok {
		ci.CloseIdleConnections()
	}
}

// mapErr names a call cut by its context as net/http does (the context's
// error), not as the connection deadline that cut it.
func mapErr(ctx context.Context, err error) error {
	if cerr := ctx.Err(); cerr != nil {
		return cerr
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		if dl, ok := ctx.Deadline(); ok && !time.Now().Before(dl) {
			return context.DeadlineExceeded
		}
	}
	return err
}

// leanBody is an answer's body on a lean connection: read to its end, the
// connection goes back to the pool; closed early, what is already buffered
// is drained (no wait), else the connection is closed.
type leanBody struct {
	t    *lean
	lc   *leanConn
	ctx  context.Context
	stop func() bool
	body io.ReadCloser
	keep bool

	reading sync.Mutex // held by Read; Close takes it only when free
	done    atomic.Bool
}

func (b *leanBody) Read(p []byte) (int, error) {
	b.reading.Lock()
	defer b.reading.Unlock()
	if b.done.Load() {
		return 0, errBodyClosed
	}
	n, err := b.body.Read(p)
	switch {
	case err == io.EOF:
		b.finish(true)
	case err != nil:
		b.finish(false)
		err = mapErr(b.ctx, err)
	}
	return n, err
}

var errBodyClosed = errors.New("read on a closed answer body")

// Close implements io.Closer. A Read blocked in another goroutine is cut
// by closing the connection under it.
func (b *leanBody) Close() error {
	if b.done.Load() {
		return nil
	}
	if !b.reading.TryLock() {
		if b.done.CompareAndSwap(false, true) {
			b.stop()
			b.lc.c.Close()
		}
		return nil
	}
	defer b.reading.Unlock()
	if b.done.Load() {
		return nil
	}
	// Only bytes already received are drained: the connection is not
	// read again (a deadline would do, but an SSH channel emulates one by
	// closing itself).
	clean := false
	if b.keep {
		b.lc.noWait = true
		_, err := io.CopyN(io.Discard, b.body, 64<<10)
		b.lc.noWait = false
		clean = err == io.EOF
	}
	b.finish(clean)
	return nil
}

// finish ends the call: back to the pool when the answer was read whole
// and neither side asked to close, the connection closed otherwise.
func (b *leanBody) finish(clean bool) {
	if !b.done.CompareAndSwap(false, true) {
		return
	}
	// stop is false when the context's cut already ran or is running:
	// the connection's deadline is then not ours to trust.
	if b.stop() && clean && b.keep {
		b.t.put(b.lc)
		return
	}
	b.lc.c.Close()
}
