package sshd

import (
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// gate keeps connections that have not authenticated yet from crowding out
// those that have (OpenSSH's LoginGraceTime and MaxStartups are the model).
// An unauthenticated connection has LoginGrace to finish, at most
// MaxStartups of them are held, at most PerSource from one address; a new
// one past a cap evicts the oldest unauthenticated one (from the same
// source first), so a flood of silent connections can delay a real login by
// one handshake, never lock it out. Authenticated connections count against
// MaxConns only.
type gate struct {
	loginGrace          time.Duration
	maxStartups, perSrc int
	maxConns            int
	now                 func() time.Time
	mu                  sync.Mutex   // guards the fields below
	pending             []*gatedConn // unauthenticated, oldest first
	byRemote            map[string]*gatedConn
	nAuthed             int
}

type gatedConn struct {
	net.Conn
	g      *gate
	source string
	// acker acknowledges received data at once (nil: the connection
	// cannot); Read uses it until authentication.
	acker quickAcker
	// authed is set under g.mu (with the counts) and read without it by
	// SetDeadline, on every packet.
	authed atomic.Bool
	once   sync.Once
	done   func() // bookkeeping to run on close once authenticated; guarded by g.mu

	dmu      sync.Mutex // guards deadline
	deadline time.Time  // the deadline last set through
}

func newGate(grace time.Duration, maxStartups, perSrc, maxConns int) *gate {
	return &gate{loginGrace: grace, maxStartups: maxStartups, perSrc: perSrc, maxConns: maxConns, now: time.Now, byRemote: map[string]*gatedConn{}}
}

func sourceOf(a net.Addr) string {
	if h, _, err := net.SplitHostPort(a.String()); err == nil {
		return h
	}
	return a.String()
}

// admit registers a new connection as unauthenticated and returns it with
// its login deadline set, plus the connections it evicted (to close).
func (g *gate) admit(c net.Conn) (*gatedConn, []*gatedConn) {
	gc := &gatedConn{Conn: c, g: g, source: sourceOf(c.RemoteAddr())}
	gc.acker, _ = c.(quickAcker)
	gc.deadline = g.now().Add(g.loginGrace)
	_ = c.SetDeadline(gc.deadline)
	g.mu.Lock()
	defer g.mu.Unlock()
	var evicted []*gatedConn
	fromSrc := 0
	for _, p := range g.pending {
		if p.source == gc.source {
			fromSrc++
		}
	}
	if fromSrc >= g.perSrc {
		for i, p := range g.pending {
			if p.source == gc.source {
				evicted = append(evicted, p)
				g.removeLocked(i)
				break
			}
		}
	}
	if len(g.pending) >= g.maxStartups {
		evicted = append(evicted, g.pending[0])
		g.removeLocked(0)
	}
	g.pending = append(g.pending, gc)
	g.byRemote[c.RemoteAddr().String()] = gc
	return gc, evicted
}

func (g *gate) removeLocked(i int) {
	p := g.pending[i]
	g.pending = append(g.pending[:i], g.pending[i+1:]...)
	if g.byRemote[p.RemoteAddr().String()] == p {
		delete(g.byRemote, p.RemoteAddr().String())
	}
}

// authenticated moves the connection from remote out of the login window:
// no deadline, no longer evictable, and opened's result runs when it
// closes. It returns the connection (nil if unknown) and false when MaxConns
// authenticated connections are already held (the caller drops this one).
func (g *gate) authenticated(remote net.Addr, opened func() (closed func())) (*gatedConn, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	gc, ok := g.byRemote[remote.String()]
	if !ok {
		return nil, false
	}
	for i, p := range g.pending {
		if p == gc {
			g.removeLocked(i)
			break
		}
	}
	if g.nAuthed >= g.maxConns {
		return gc, false
	}
	g.nAuthed++
	gc.authed.Store(true)
	if opened != nil {
		gc.done = opened()
	}
	gc.dmu.Lock()
	gc.deadline = time.Time{}
	_ = gc.Conn.SetDeadline(time.Time{})
	gc.dmu.Unlock()
	return gc, true
}

// SetDeadline holds the login deadline until authentication and passes
// later deadlines through, skipping repeats. The SSH server library sets
// the deadline before every read and write (to none when it has no
// timeouts of its own): that lifted the login deadline at the first read,
// so a stalled client was never dropped, and cost a runtime timer
// operation per packet.
func (c *gatedConn) SetDeadline(t time.Time) error {
	c.dmu.Lock()
	defer c.dmu.Unlock()
	if !c.authed.Load() || t.Equal(c.deadline) {
		return nil
	}
	c.deadline = t
	return c.Conn.SetDeadline(t)
}

// quickAcker is a connection that can acknowledge received data at once
// (rawnet.Conn on TCP).
type quickAcker interface{ QuickAck() }

// Read acknowledges what it read at once until authentication: the
// client's key exchange and service request otherwise wait on this side's
// delayed acknowledgement (see rawnet.Conn.QuickAck). After it, reads are
// left as they are: an interactive client turns Nagle off itself, and a
// forward's bulk data should not pay a system call per read.
func (c *gatedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 && c.acker != nil && !c.authed.Load() {
		c.acker.QuickAck()
	}
	return n, err
}

// closed releases gc's place and returns its close bookkeeping.
func (g *gate) closed(gc *gatedConn) (done func()) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if gc.authed.Load() {
		g.nAuthed--
		return gc.done
	}
	for i, p := range g.pending {
		if p == gc {
			g.removeLocked(i)
			break
		}
	}
	return nil
}

// counts returns the unauthenticated and authenticated connections held.
func (g *gate) counts() (pending, authed int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.pending), g.nAuthed
}

func (c *gatedConn) Close() error {
	c.once.Do(func() {
		if done := c.g.closed(c); done != nil {
			done()
		}
	})
	return c.Conn.Close()
}
