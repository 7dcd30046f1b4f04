package sshd

import (
	"net"
	"sync"
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
	authed bool
	once   sync.Once
	done   func() // the tracker's bookkeeping
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
func (g *gate) admit(c net.Conn, done func()) (*gatedConn, []*gatedConn) {
	gc := &gatedConn{Conn: c, g: g, source: sourceOf(c.RemoteAddr()), done: done}
	_ = c.SetDeadline(g.now().Add(g.loginGrace))
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
// no deadline, no longer evictable. False when MaxConns authenticated
// connections are already held (the caller drops this one).
func (g *gate) authenticated(remote net.Addr) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	gc, ok := g.byRemote[remote.String()]
	if !ok {
		return false
	}
	for i, p := range g.pending {
		if p == gc {
			g.removeLocked(i)
			break
		}
	}
	if g.nAuthed >= g.maxConns {
		return false
	}
	g.nAuthed++
	gc.authed = true
	_ = gc.Conn.SetDeadline(time.Time{})
	return true
}

func (g *gate) closed(gc *gatedConn) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if gc.authed {
		g.nAuthed--
		return
	}
	for i, p := range g.pending {
		if p == gc {
			g.removeLocked(i)
			return
		}
	}
}

// counts returns the unauthenticated and authenticated connections held.
func (g *gate) counts() (pending, authed int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.pending), g.nAuthed
}

func (c *gatedConn) Close() error {
	c.once.Do(func() {
		c.g.closed(c)
		if c.done != nil {
			c.done()
		}
	})
	return c.Conn.Close()
}
