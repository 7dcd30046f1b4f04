package httpapi

import (
	"errors"
	"io"
	"net/http"
	"sync"
	"time"
)

// Limits bound what one client can hold of an agent: connections, time and
// header bytes. Bodies are bounded per route (MaxBodyBytes for JSON, the
// runner's upload limits); here they are bounded in time: a body must keep
// arriving at MinBodyRate after BodyGrace, and no read may stall longer
// than BodyIdle.
type Limits struct {
	MaxConns          int           // open connections (Gate); more wait in the kernel's backlog
	Reserve           int           // of MaxConns, slots only trusted callers may take (Gate)
	ReadHeaderTimeout time.Duration // request line and headers
	IdleTimeout       time.Duration // keep-alive connection with no request
	BodyIdle          time.Duration // longest pause inside a request body
	BodyGrace         time.Duration // before MinBodyRate applies
	MinBodyRate       int64         // bytes per second, averaged over the body
	MaxHeaderBytes    int
	WriteTimeout      time.Duration // 0: none (log streams and long polls)
}

// DefaultLimits are generous for dstack's server and our client, and finite
// for everyone else.
var DefaultLimits = Limits{
	MaxConns:          512,
	Reserve:           64,
	ReadHeaderTimeout: 10 * time.Second,
	IdleTimeout:       90 * time.Second,
	BodyIdle:          30 * time.Second,
	BodyGrace:         30 * time.Second,
	MinBodyRate:       16 << 10,
	MaxHeaderBytes:    64 << 10,
}

// NewServer returns an http.Server for h with lim applied. Serve it on a
// Gate (NewGate, then Attach) to cap connections.
func NewServer(h http.Handler, lim Limits) *http.Server {
	return &http.Server{
		Handler:           bodyDeadlines(h, lim),
		ReadHeaderTimeout: lim.ReadHeaderTimeout,
		IdleTimeout:       lim.IdleTimeout,
		MaxHeaderBytes:    lim.MaxHeaderBytes,
		WriteTimeout:      lim.WriteTimeout,
	}
}

// bodyDeadlines moves the connection's read deadline along as a request
// body arrives: BodyIdle after the last read, and never later than the time
// the body would take at MinBodyRate (plus BodyGrace). A stalled or
// trickling body fails its read with a timeout; the handler answers 400.
func bodyDeadlines(h http.Handler, lim Limits) http.Handler {
	if lim.BodyIdle <= 0 {
		return h
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Body == nil || r.Body == http.NoBody {
			h.ServeHTTP(w, r)
			return
		}
		rc := http.NewResponseController(w)
		b := &deadlineBody{rc: rc, body: r.Body, lim: lim, start: time.Now(), gc: gateConnOf(r.Context())}
		if err := b.extend(); err != nil {
			// Not a connection that takes deadlines (a test recorder).
			h.ServeHTTP(w, r)
			return
		}
		r.Body = b
		if b.gc != nil {
			// Until the body is in, a full gate may cut this connection.
			b.gc.setBody(true)
			defer b.gc.setBody(false)
		}
		h.ServeHTTP(w, r)
		if !b.eof() {
			// The server may still discard the rest of the body: bounded too.
			_ = rc.SetReadDeadline(time.Now().Add(lim.BodyIdle))
		}
	})
}

type deadlineBody struct {
	rc    *http.ResponseController
	body  io.ReadCloser
	lim   Limits
	start time.Time
	gc    *gateConn // nil: not through a gate

	mu   sync.Mutex
	n    int64
	done bool // the body was read to its end
}

func (b *deadlineBody) eof() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.done
}

func (b *deadlineBody) extend() error {
	now := time.Now()
	d := now.Add(b.lim.BodyIdle)
	if b.lim.MinBodyRate > 0 {
		rate := b.start.Add(b.lim.BodyGrace + time.Duration(float64(b.n)/float64(b.lim.MinBodyRate)*float64(time.Second)))
		if rate.Before(d) {
			d = rate
		}
	}
	if !d.After(now) {
		return errBodyTooSlow
	}
	return b.rc.SetReadDeadline(d)
}

var errBodyTooSlow = errors.New("request body arrives too slowly")

func (b *deadlineBody) Read(p []byte) (int, error) {
	n, err := b.body.Read(p)
	b.mu.Lock()
	b.n += int64(n)
	if err == io.EOF {
		b.done = true
	}
	b.mu.Unlock()
	if err == io.EOF && b.gc != nil {
		b.gc.setBody(false)
	}
	if err == io.EOF {
		// Past the body the server reads the connection in the background
		// (to notice a client that goes away): no deadline may cut that,
		// or it would cancel the request's context.
		_ = b.rc.SetReadDeadline(time.Time{})
		return n, err
	}
	if err != nil {
		return n, err
	}
	if derr := b.extend(); derr != nil {
		return n, derr
	}
	return n, nil
}

func (b *deadlineBody) Close() error { return b.body.Close() }
