package httpapi

// An admitted connection's slot: taken at accept, its place in the
// eviction order, released when the server closes it.

import (
	"context"
	"net"
	"net/http"
	"time"
)

// tryAcquire takes a slot for c, making one by eviction when none is
// free; nil when every slot it may use serves a request.
func (g *Gate) tryAcquire(c net.Conn, v Admission) *gateConn {
	g.mu.Lock()
	limit := g.lim.MaxConns
	if !v.Trusted {
		limit -= g.lim.Reserve
	}
	var victim *gateConn
	full := true
	switch {
	case v.Key != "" && g.held[v.Key] >= g.keyCap:
		// At its share: it may only replace one of its own.
		victim = g.victimLocked(v.Trusted, v.Key)
	case g.used >= limit:
		victim = g.victimLocked(v.Trusted, "")
	default:
		full = false
	}
	if full && victim == nil {
		g.mu.Unlock()
		return nil
	}
	if victim != nil {
		g.releaseLocked(victim)
		g.stats.Evicted++
	}
	gc := &gateConn{Conn: c, g: g, adm: v, state: http.StateNew, since: g.now()}
	g.used++
	g.conns[gc] = struct{}{}
	if v.Key != "" {
		g.held[v.Key]++
	}
	g.mu.Unlock()
	if victim != nil {
		g.log.Debug("API connection evicted to make room", "peer", victim.adm.Peer, "state", victim.state.String(), "for", v.Peer)
		_ = victim.Conn.Close()
	}
	return gc
}

// victimLocked picks the connection to cut for a newcomer: idle keep-alive
// first (longest idle), then new without a request (oldest), then a request
// body arriving for more than bodyEvictAge (oldest); within a tier, the
// client holding the most slots loses first. An untrusted newcomer cuts
// only untrusted connections; key, when set, limits the choice to that
// client's own.
func (g *Gate) victimLocked(trusted bool, key string) *gateConn {
	now := g.now()
	var best *gateConn
	bestTier := 4
	for gc := range g.conns {
		if !trusted && gc.adm.Trusted || key != "" && gc.adm.Key != key {
			continue
		}
		tier := 4
		switch {
		case gc.state == http.StateIdle:
			tier = 1
		case gc.state == http.StateNew && now.Sub(gc.since) >= newGrace:
			tier = 2
		case gc.state == http.StateActive && gc.body && now.Sub(gc.bodySince) >= bodyEvictAge:
			tier = 3
		}
		if tier == 4 {
			continue
		}
		if tier < bestTier || tier == bestTier && g.before(gc, best) {
			best, bestTier = gc, tier
		}
	}
	return best
}

// before orders victims of one tier: the bigger holder (connections
// without a key count as holding none), then the older.
func (g *Gate) before(a, b *gateConn) bool {
	if ha, hb := g.held[a.adm.Key], g.held[b.adm.Key]; ha != hb {
		return ha > hb
	}
	return a.key().Before(b.key())
}

func (g *Gate) releaseLocked(gc *gateConn) {
	if gc.released {
		return
	}
	gc.released = true
	delete(g.conns, gc)
	g.used--
	if k := gc.adm.Key; k != "" {
		if g.held[k]--; g.held[k] <= 0 {
			delete(g.held, k)
		}
	}
	g.signal()
}

func (g *Gate) signal() {
	select {
	case g.wake <- struct{}{}:
	default:
	}
}

// Attach sets hs's ConnState and ConnContext hooks (keeping any already
// set): the gate follows each connection's state, and requests find their
// connection (ConnAdmission, the body phase).
func (g *Gate) Attach(hs *http.Server) {
	prevState, prevCtx := hs.ConnState, hs.ConnContext
	hs.ConnState = func(c net.Conn, s http.ConnState) {
		g.connState(c, s)
		if prevState != nil {
			prevState(c, s)
		}
	}
	hs.ConnContext = func(ctx context.Context, c net.Conn) context.Context {
		ctx = connContext(ctx, c)
		if prevCtx != nil {
			ctx = prevCtx(ctx, c)
		}
		return ctx
	}
}

// connState is http.Server.ConnState for the gate's connections.
func (g *Gate) connState(c net.Conn, s http.ConnState) {
	gc, ok := c.(*gateConn)
	if !ok {
		return
	}
	g.mu.Lock()
	gc.state, gc.since, gc.body = s, g.now(), false
	g.mu.Unlock()
	if s == http.StateIdle {
		g.signal()
	}
}

// setBody marks whether the connection's request body is still arriving.
func (gc *gateConn) setBody(on bool) {
	g := gc.g
	g.mu.Lock()
	gc.body = on
	if on {
		gc.bodySince = g.now()
	}
	g.mu.Unlock()
}

type gateConn struct {
	net.Conn
	g   *Gate
	adm Admission

	// guarded by g.mu
	state     http.ConnState
	since     time.Time // of the last state change
	body      bool      // a request body is arriving
	bodySince time.Time
	released  bool
}

func (gc *gateConn) key() time.Time {
	if gc.body {
		return gc.bodySince
	}
	return gc.since
}

func (gc *gateConn) Close() error {
	err := gc.Conn.Close()
	gc.g.mu.Lock()
	gc.g.releaseLocked(gc)
	gc.g.mu.Unlock()
	return err
}

type gateConnKey struct{}

// connContext is http.Server.ConnContext: requests find their connection.
func connContext(ctx context.Context, c net.Conn) context.Context {
	if gc, ok := c.(*gateConn); ok {
		return context.WithValue(ctx, gateConnKey{}, gc)
	}
	return ctx
}

func gateConnOf(ctx context.Context) *gateConn {
	gc, _ := ctx.Value(gateConnKey{}).(*gateConn)
	return gc
}

// ConnAdmission returns the gate's verdict on the connection a request
// arrived on; false when it did not come through a gate.
func ConnAdmission(ctx context.Context) (Admission, bool) {
	if gc := gateConnOf(ctx); gc != nil {
		return gc.adm, true
	}
	return Admission{}, false
}
