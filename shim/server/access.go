package server

import (
	"crypto/subtle"
	"log/slog"
	"mime"
	"net"
	"net/http"
	"strings"

	"github.com/labstack/echo/v4"

	"github.com/tandem-run/tandem/common/httpapi"
	"github.com/tandem-run/tandem/shim/origin"
	"github.com/tandem-run/tandem/shim/principal"
)

// Access decides who may drive the shim. The API can start privileged
// containers with any host path mounted: it is root on the host, so by
// default only the host itself may call it. The dstack server arrives
// through the host's sshd on loopback, tandem runs on the host or tunnels
// the same way; a job, even in host network mode, runs in a container and
// is refused.
type Access struct {
	// AllowContainers is the kill switch for the origin check.
	AllowContainers bool
	// Token, when set, is a second factor: every request must carry
	// "Authorization: Bearer <Token>".
	Token string
	// AllowedHosts are accepted in the Host header besides loopback names
	// ("*" accepts any). A browser tricked by DNS rebinding sends its own
	// domain there.
	AllowedHosts []string
	// Check resolves connections' origins (origin.Checker.CheckBatch); the
	// API's httpapi.Gate calls it through Admit when it accepts them.
	Check func([]origin.Pair) []origin.Verdict
	// Principals decides which local accounts may drive the shim, by the
	// uid that owns the client's socket (principal.Policy); nil admits
	// every uid.
	Principals Principals
	Log        *slog.Logger
}

// Principals answers whether a local uid is root-equivalent.
type Principals interface {
	Decide(uid uint32) principal.Decision
}

// decide is the verdict on one connection: from the host (not a
// container) and owned by an admitted uid. A refusal carries the whole
// message the client reads, about what (the shim API, a task port).
func (a Access) decide(v origin.Verdict, what string) (admit bool, msg string) {
	if !v.FromHost && !a.AllowContainers {
		return false, what + " serves only the host itself, not " + v.Peer + ": " + v.Reason
	}
	if a.Principals != nil {
		// Every uid behind the socket: its maker's and each holder's.
		for _, uid := range v.UIDs {
			if d := a.Principals.Decide(uid); !d.Allowed {
				return false, what + " serves only root-equivalent accounts (root, accounts the host's sudo lets run a shell as root, the Docker socket's group, --api-allow-user): " + d.Error() + "; caller " + v.Peer
			}
		}
	}
	return true, ""
}

const (
	theAPI      = "the shim API"
	taskPort    = "this task port"
	loopbackReg = "the fast pull's loopback registry"
)

func loopbackHost(h string) bool {
	// The dstack server tunnels to local Unix sockets and talks HTTP over
	// them (requests-unixsocket): its Host is the URL-quoted socket path,
	// "%2Ftmp%2F...". No browser can send that.
	if lh := strings.ToLower(h); strings.HasPrefix(lh, "%2f") || strings.HasPrefix(h, "/") {
		return true
	}
	if host, _, err := net.SplitHostPort(h); err == nil {
		h = host
	}
	h = strings.Trim(strings.ToLower(h), "[]")
	if h == "localhost" || strings.HasSuffix(h, ".localhost") || h == "agent.sock" {
		return true
	}
	ip := net.ParseIP(h)
	return ip != nil && ip.IsLoopback()
}

func (a Access) hostAllowed(h string) bool {
	if loopbackHost(h) {
		return true
	}
	name := h
	if host, _, err := net.SplitHostPort(h); err == nil {
		name = host
	}
	for _, allowed := range a.AllowedHosts {
		if allowed == "*" || strings.EqualFold(allowed, name) || strings.EqualFold(allowed, h) {
			return true
		}
	}
	return false
}

// Middleware enforces, in order: the Host header (421), the caller's
// origin (403), the token (401) and a JSON Content-Type on any body (415).
// Each refusal is logged with the peer.
func (a Access) Middleware() echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			r := c.Request()
			peer := r.RemoteAddr
			refuse := func(status int, msg string, attrs ...any) error {
				a.Log.Warn("shim API refused", append([]any{"peer", peer, "method", r.Method, "path", r.URL.Path, "status", status, "why", msg}, attrs...)...)
				return httpapi.Errorf(status, "%s", msg)
			}
			if !a.hostAllowed(r.Host) {
				return refuse(http.StatusMisdirectedRequest, "Host "+r.Host+" is not this shim's; use localhost or a name given with --api-allowed-host")
			}
			if a.Check != nil {
				v := a.verdict(r)
				if v.Peer != "" {
					peer = v.Peer
				}
				if ok, msg := a.decide(v, theAPI); !ok {
					return refuse(http.StatusForbidden, msg)
				}
			}
			if a.Token != "" {
				got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
				if !ok || subtle.ConstantTimeCompare([]byte(got), []byte(a.Token)) != 1 {
					return refuse(http.StatusUnauthorized, "a valid bearer token is required")
				}
			}
			if r.ContentLength != 0 && r.Body != nil && r.Body != http.NoBody {
				mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
				if err != nil || mt != "application/json" {
					return refuse(http.StatusUnsupportedMediaType, "Content-Type header is not application/json")
				}
			}
			return next(c)
		}
	}
}

// Admit decides connections for the API's httpapi.Gate with Check: a
// container's connection is refused when it is accepted, before it holds a
// slot, unless AllowContainers; only the host's connections are trusted
// with the reserved slots.
func (a Access) Admit() httpapi.Admit {
	return func(conns []net.Conn) []httpapi.Admission {
		pairs := make([]origin.Pair, len(conns))
		for i, c := range conns {
			pairs[i] = origin.Pair{Local: c.LocalAddr(), Remote: c.RemoteAddr()}
		}
		vs := a.Check(pairs)
		out := make([]httpapi.Admission, len(conns))
		for i, v := range vs {
			ok, msg := a.decide(v, theAPI)
			out[i] = httpapi.Admission{Trusted: ok && v.FromHost, Peer: v.Peer, Reason: v.Reason,
				Refuse: !ok, Message: msg, Key: v.Client}
			if !ok && v.FromHost {
				out[i].Reason = "uid not root-equivalent"
			}
		}
		return out
	}
}

// AdmitConn decides one connection by the same rule as the API (a
// root-equivalent account on the host, not a container): the shim's
// forwarded task ports use it, and log its refusals. The Host header and
// token do not apply: what passes is the runner's own protocol.
func (a Access) AdmitConn(c net.Conn) (bool, string) {
	return a.admitConn(c, taskPort)
}

// AdmitRegistryConn decides a connection to a fast pull's loopback
// registry (shim/fastpull) by the same rule: Docker's daemon passes, and
// another local account may not read a task's image there.
func (a Access) AdmitRegistryConn(c net.Conn) (bool, string) {
	return a.admitConn(c, loopbackReg)
}

func (a Access) admitConn(c net.Conn, what string) (bool, string) {
	if a.Check == nil {
		return true, ""
	}
	return a.decide(a.Check([]origin.Pair{{Local: c.LocalAddr(), Remote: c.RemoteAddr()}})[0], what)
}

// verdict is the origin the gate decided for the request's connection (a
// connection the gate let through was admitted, uid included); a
// connection that did not come through the gate is not the host's.
func (a Access) verdict(r *http.Request) origin.Verdict {
	if adm, ok := httpapi.ConnAdmission(r.Context()); ok {
		return origin.Verdict{FromHost: adm.Trusted || a.AllowContainers && !adm.Refuse, Peer: adm.Peer, Reason: adm.Reason}
	}
	return origin.Verdict{Peer: r.RemoteAddr, Reason: "the connection was not decided by the API's gate"}
}
