package httpapi

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/tandem-run/tandem/common/rawnet"
)

// Admission is the verdict on one accepted connection.
type Admission struct {
	// Refuse closes the connection at once (after a short 403 with
	// Reason): it never holds a slot.
	Refuse bool
	// Trusted connections may take the reserved slots and evict any
	// evictable connection; the others use the shared slots and evict only
	// each other.
	Trusted bool
	// Peer names the client for logs ("127.0.0.1:41234 pid 812 (sh)").
	Peer string
	// Reason says why a connection is refused or not trusted.
	Reason string
	// Message, when set, is the whole text a refused client reads (else
	// "the API serves only the host itself, not <Peer>: <Reason>").
	Message string
	// Key groups a client's connections for fairness (the shim uses the
	// owning process): one key holds at most a quarter of the slots and a
	// few waiting places, so a single flooding client cannot crowd out the
	// others. "": no limit of its own.
	Key string
}

// Admit decides a batch of freshly accepted connections: one Admission per
// connection, in order. Deciding a batch at once lets a costly lookup (the
// shim walks /proc to find who owns a socket) run once for a whole flood.
type Admit func(conns []net.Conn) []Admission

// Gate is a listener that decides who a connection is before it costs a
// slot, and keeps slots for the callers that matter when they run short:
//
//   - Connections are accepted as fast as they come and decided in batches
//     (Admit); a refused one is answered 403 and closed without ever
//     holding a slot, so a flood of refused clients cannot starve others.
//   - Open connections are capped at MaxConns; the last Reserve slots only
//     trusted connections may take.
//   - One client (Admission.Key) holds at most a quarter of the slots and
//     a few places in the queue for them; past that its new connections
//     are closed at once, and a client at its cap can only replace one of
//     its own connections.
//   - When no slot is free, one is made: an idle keep-alive connection is
//     closed first (the longest idle), then one that has sent no request
//     yet, then one whose request body has been arriving the longest.
//     Connections whose request is being served are never cut; when every
//     slot serves one, new connections wait in the kernel's backlog.
//
// Serve it with an http.Server from NewServer (whose ConnState and
// ConnContext the gate needs).
type Gate struct {
	ln    net.Listener
	lim   Limits
	admit Admit
	log   *slog.Logger
	now   func() time.Time

	pending chan net.Conn // accepted, not yet decided
	ready   chan *gateConn
	done    chan struct{}
	linger  chan struct{} // refused connections being closed gracefully
	wake    chan struct{} // a slot may have become free or evictable

	closeOnce sync.Once
	errMu     sync.Mutex
	err       error // the listener's permanent error

	keyCap int            // slots one key may hold
	queued map[string]int // waiters per key; admitLoop's alone

	mu    sync.Mutex // guards the fields below and every gateConn's state
	conns map[*gateConn]struct{}
	used  int
	held  map[string]int // slots per Admission.Key (non-empty keys only)
	stats GateStats
	// refusal log rate limit
	lastLog    time.Time
	suppressed int
}

// GateStats are the gate's counters.
type GateStats struct {
	Open, Refused, Evicted, Shed int64 // Shed: closed at once, their client over its share
}

// Batch and grace bounds of the gate.
const (
	gatePending  = 256                    // accepted connections waiting for a decision
	gateBatch    = 256                    // connections decided at once
	gateWaiting  = 256                    // admitted connections waiting for a slot
	keyWaiting   = 16                     // of which one key may hold
	gateLinger   = 64                     // refused connections drained at once
	lingerFor    = 500 * time.Millisecond // drain of a refused connection's request
	newGrace     = 100 * time.Millisecond // a new connection's time to start its request
	bodyEvictAge = time.Second            // a body arriving this long may be cut when full
)

// NewGate starts accepting on ln. admit nil trusts every connection.
func NewGate(ln net.Listener, lim Limits, admit Admit, log *slog.Logger) *Gate {
	g := &Gate{ln: ln, lim: lim, admit: admit, log: log, now: time.Now,
		pending: make(chan net.Conn, gatePending), ready: make(chan *gateConn), done: make(chan struct{}),
		linger: make(chan struct{}, gateLinger), wake: make(chan struct{}, 1), conns: map[*gateConn]struct{}{},
		held: map[string]int{}, queued: map[string]int{}}
	if g.lim.MaxConns <= 0 {
		g.lim.MaxConns = DefaultLimits.MaxConns
	}
	g.keyCap = max(1, g.lim.MaxConns/4)
	g.lim.Reserve = min(max(g.lim.Reserve, 0), g.lim.MaxConns-1)
	go g.acceptLoop()
	go g.admitLoop()
	return g
}

// Accept returns the next admitted connection.
func (g *Gate) Accept() (net.Conn, error) {
	select {
	case c := <-g.ready:
		return c, nil
	case <-g.done:
		g.errMu.Lock()
		defer g.errMu.Unlock()
		if g.err != nil {
			return nil, g.err
		}
		return nil, net.ErrClosed
	}
}

// Close stops accepting; open connections stay (http.Server closes them).
func (g *Gate) Close() error {
	err := g.ln.Close()
	g.closeOnce.Do(func() { close(g.done) })
	return err
}

// Addr is the listener's address.
func (g *Gate) Addr() net.Addr { return g.ln.Addr() }

func (g *Gate) acceptLoop() {
	var backoff time.Duration
	for {
		c, err := g.ln.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() || errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) ||
				errors.Is(err, syscall.ECONNABORTED) {
				// Out of descriptors: wait for some to come back.
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				g.log.Warn("accept failed; retrying", "err", err, "in", backoff)
				select {
				case <-time.After(backoff):
					continue
				case <-g.done:
					return
				}
			}
			g.errMu.Lock()
			if g.err == nil && !errors.Is(err, net.ErrClosed) {
				g.err = err
			}
			g.errMu.Unlock()
			g.closeOnce.Do(func() { close(g.done) })
			return
		}
		backoff = 0
		// Raw reads and writes (common/rawnet): a request's read and its
		// response's write keep the P, so sysmon finds no P in a system
		// call to take, stops waking every 20 µs, and no thread is woken
		// to run what the call left behind. On 2 vCPUs that took the
		// shim's CPU per GET /api/tasks/{id} from 90 to 50-60 µs.
		c = rawnet.Wrap(c)
		select {
		case g.pending <- c:
		case <-g.done:
			c.Close()
			return
		}
	}
}

// waiter is an admitted connection waiting for a slot.
type waiter struct {
	c     net.Conn
	adm   Admission
	since time.Time
}

// admitLoop decides what acceptLoop accepted and hands admitted
// connections to Accept. It never blocks on one connection: those that
// find no slot wait in a bounded list (trusted ones served first), retried
// whenever a slot may have freed, while newer connections are still
// decided; only when that list is full does intake stop, leaving newer
// clients in the kernel's backlog.
func (g *Gate) admitLoop() {
	batch := make([]net.Conn, 0, gateBatch)
	var waiting []waiter
	defer func() {
		for _, w := range waiting {
			w.c.Close()
		}
		g.drainPending()
	}()
	for {
		waiting = g.serveWaiting(waiting)
		if waiting == nil && g.isDone() {
			return
		}
		var intake chan net.Conn
		if len(waiting) < gateWaiting {
			intake = g.pending
		}
		var tick <-chan time.Time
		if len(waiting) > 0 {
			tick = time.After(50 * time.Millisecond) // ages move on: re-check
		}
		select {
		case c := <-intake:
			batch = append(batch[:0], c)
		case <-g.wake:
			continue
		case <-tick:
			continue
		case <-g.done:
			return
		}
	more:
		for len(batch) < gateBatch {
			select {
			case c := <-g.pending:
				batch = append(batch, c)
			default:
				break more
			}
		}
		var verdicts []Admission
		if g.admit != nil {
			verdicts = g.admit(batch)
		}
		for i, c := range batch {
			v := Admission{Trusted: true, Peer: c.RemoteAddr().String()}
			if g.admit != nil {
				if i < len(verdicts) {
					v = verdicts[i]
				} else {
					v = Admission{Refuse: true, Peer: c.RemoteAddr().String(), Reason: "no verdict for this connection"}
				}
			}
			if v.Refuse {
				g.refuse(c, v)
				continue
			}
			if v.Key != "" && g.queued[v.Key] >= keyWaiting {
				// Its share of the waiting list is taken: those waiters
				// get the free slots first, and only a client still over
				// its share is shed. (Shedding at once reset 48 of 64
				// concurrent requests of one client to an idle shim.)
				waiting = g.serveWaiting(waiting)
			}
			if v.Key != "" && g.queued[v.Key] >= keyWaiting {
				g.shed(c)
				continue
			}
			if v.Key != "" {
				g.queued[v.Key]++
			}
			waiting = append(waiting, waiter{c: c, adm: v, since: g.now()})
		}
	}
}

// serveWaiting hands every waiter that gets a slot to Accept, trusted ones
// first, and drops those that waited past the header timeout (their client
// has given up or will retry). It returns those still waiting (nil: none).
func (g *Gate) serveWaiting(waiting []waiter) []waiter {
	if len(waiting) == 0 {
		return nil
	}
	slices.SortStableFunc(waiting, func(a, b waiter) int {
		switch {
		case a.adm.Trusted == b.adm.Trusted:
			return 0
		case a.adm.Trusted:
			return -1
		}
		return 1
	})
	maxWait := g.lim.ReadHeaderTimeout
	if maxWait <= 0 {
		maxWait = DefaultLimits.ReadHeaderTimeout
	}
	now := g.now()
	rest := waiting[:0]
	for _, w := range waiting {
		if now.Sub(w.since) > maxWait {
			g.unqueue(w.adm.Key)
			w.c.Close()
			continue
		}
		gc := g.tryAcquire(w.c, w.adm)
		if gc == nil {
			rest = append(rest, w)
			continue
		}
		g.unqueue(w.adm.Key)
		select {
		case g.ready <- gc:
		case <-g.done:
			gc.Close()
		}
	}
	if len(rest) == 0 {
		return nil
	}
	return rest
}

func (g *Gate) unqueue(key string) {
	if key == "" {
		return
	}
	if g.queued[key]--; g.queued[key] <= 0 {
		delete(g.queued, key)
	}
}

// shed closes a connection whose client already waits with its share.
func (g *Gate) shed(c net.Conn) {
	g.mu.Lock()
	g.stats.Shed++
	g.mu.Unlock()
	c.Close()
}

func (g *Gate) isDone() bool {
	select {
	case <-g.done:
		return true
	default:
		return false
	}
}

func (g *Gate) drainPending() {
	for {
		select {
		case c := <-g.pending:
			c.Close()
		default:
			return
		}
	}
}

// refuse answers 403 with the reason and closes c, draining what the
// client sent meanwhile (closing over unread data would reset the
// connection and lose the answer) for a bounded time and number.
func (g *Gate) refuse(c net.Conn, v Admission) {
	g.mu.Lock()
	g.stats.Refused++
	now := g.now()
	logIt := now.Sub(g.lastLog) >= time.Second
	n := g.suppressed
	if logIt {
		g.lastLog, g.suppressed = now, 0
	} else {
		g.suppressed++
	}
	g.mu.Unlock()
	if logIt {
		g.log.Warn("API connection refused", "peer", v.Peer, "status", http.StatusForbidden, "why", v.Reason, "refused_since_last_line", n)
	}
	msg := v.Message
	if msg == "" {
		msg = "the API serves only the host itself, not " + v.Peer + ": " + v.Reason
	}
	resp := fmt.Sprintf("HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", len(msg), msg)
	_ = c.SetWriteDeadline(now.Add(50 * time.Millisecond))
	if _, err := io.WriteString(c, resp); err != nil {
		c.Close()
		return
	}
	select {
	case g.linger <- struct{}{}:
	default:
		c.Close() // too many lingering: no grace for this one
		return
	}
	go func() {
		defer func() { <-g.linger }()
		if cw, ok := c.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite()
		}
		_ = c.SetReadDeadline(time.Now().Add(lingerFor))
		_, _ = io.CopyN(io.Discard, c, 64<<10)
		c.Close()
	}()
}
