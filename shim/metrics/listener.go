package metrics

// The metrics listener (--metrics-address): /metrics alone, for scrapers
// anywhere, on slots that no one peer can keep from the others.

import (
	"errors"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"time"

	"github.com/tandem-run/tandem/common/httpapi"
)

// Bounds of the metrics listener. A scrape is one small GET: its request
// arrives in one packet and its answer (6.6 KiB on an idle shim) fits in
// the sockets' buffers, so every bound here is generous for a scraper and
// short for anyone holding a connection.
const (
	// ListenerConns is how many connections are open at once; one peer
	// holds at most a quarter (httpapi.Gate's share: 8). When all are
	// taken a newcomer closes one still sending its request line (after
	// 100 ms): such a connection is never a reason for a scraper to wait.
	ListenerConns = 32
	// ListenerHeader bounds the request line and headers, ListenerRead the
	// whole request (it has no body), ListenerWrite the answer.
	ListenerHeader      = 5 * time.Second
	ListenerRead        = 5 * time.Second
	ListenerWrite       = 10 * time.Second
	listenerHeaderBytes = 16 << 10
)

// Listener serves a handler on the metrics address.
type Listener struct {
	gate *httpapi.Gate
	hs   *http.Server
}

// Listen serves h's GET /metrics on ln (and nothing else there: 404) until
// Close. Connections are grouped by peer (PeerKey) for their share of the
// slots, and each serves one request: a scraper asks every 15-60 s, and a
// new connection costs it one handshake, while a kept-alive one is a slot
// held between requests for as long as its peer likes (one request every
// 20 s on each of the 32 kept every scrape out), and pipelined requests
// whose answers are not read hold it busy.
func Listen(ln net.Listener, h http.Handler, log *slog.Logger) *Listener {
	log = log.With("listener", "metrics")
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", h)
	lim := httpapi.Limits{MaxConns: ListenerConns, ReadHeaderTimeout: ListenerHeader, MaxHeaderBytes: listenerHeaderBytes,
		WriteTimeout: ListenerWrite}
	hs := &http.Server{Handler: noBody(mux), ReadHeaderTimeout: lim.ReadHeaderTimeout, ReadTimeout: ListenerRead,
		WriteTimeout: lim.WriteTimeout, MaxHeaderBytes: lim.MaxHeaderBytes,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug)}
	hs.SetKeepAlivesEnabled(false)
	gate := httpapi.NewGate(ln, lim, admitPeers, log)
	gate.Attach(hs)
	l := &Listener{gate: gate, hs: hs}
	go func() {
		if err := hs.Serve(gate); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("metrics listener", "err", err)
		}
	}()
	return l
}

// Addr is the listener's address.
func (l *Listener) Addr() net.Addr { return l.gate.Addr() }

// Close stops the listener and its connections.
func (l *Listener) Close() error { return l.hs.Close() }

// admitPeers lets every connection in (the metrics are anyone's) and
// groups it with its peer's others for their share of the slots.
func admitPeers(conns []net.Conn) []httpapi.Admission {
	v := make([]httpapi.Admission, len(conns))
	for i, c := range conns {
		v[i] = httpapi.Admission{Peer: c.RemoteAddr().String(), Key: PeerKey(c.RemoteAddr())}
	}
	return v
}

// PeerKey names the peer a connection's slots are counted against: its
// IP address, or for IPv6 beyond loopback its /64 (one host's share of
// addresses: anyone with one has 2^64 of them). A local account may pick
// any source in 127/8 and so any number of keys; what keeps it from the
// slots then is eviction, which spares no idle connection of any key.
func PeerKey(a net.Addr) string {
	ap, err := netip.ParseAddrPort(a.String())
	if err != nil {
		return a.String()
	}
	ip := ap.Addr().Unmap().WithZone("")
	if ip.Is4() || ip.IsLoopback() {
		return ip.String()
	}
	p, _ := ip.Prefix(64)
	return p.String()
}

// noBody refuses a request with a body, and closes its connection without
// reading the body: the server would otherwise read up to 256 KiB of it
// after the answer, as slowly as the client likes, with the connection
// counted as serving a request (which no newcomer may cut).
func noBody(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ContentLength != 0 {
			// A read deadline already past ends that read at once.
			_ = http.NewResponseController(w).SetReadDeadline(time.Now())
			w.Header().Set("Connection", "close")
			http.Error(w, "a scrape has no request body", http.StatusBadRequest)
			return
		}
		h.ServeHTTP(w, r)
	})
}
