// Package sshd is the runner's embedded SSH server: any image becomes
// reachable without OpenSSH. It authenticates with public keys only, runs
// sessions and sftp as the login user, and forwards TCP ports, Unix sockets
// and the client's agent.
package sshd

import (
	"context"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	gssh "github.com/gliderlabs/ssh"
	gossh "golang.org/x/crypto/ssh"

	"github.com/tandem-run/tandem/common/atomicfile"
	"github.com/tandem-run/tandem/runner/executor"
)

// Config is how the server runs.
type Config struct {
	Addr       string
	HostKeyDir string // host keys are created here once and reused
	Accounts   executor.Accounts
	// Env returns the environment sessions start from: the job's once it
	// runs, else the runner's.
	Env        func() []string
	CanSetUser bool
	// Self is the runner binary, re-executed as the sftp server.
	Self     string
	MaxConns int
	// KeepAlive probes idle clients; KeepAliveMax unanswered probes drop them.
	KeepAlive    time.Duration
	KeepAliveMax int
	Tracker      *Tracker
	Log          *slog.Logger
	// MaxChannels caps concurrent channels per connection (IDEs multiplex
	// dozens; thousands would be abuse).
	MaxChannels int
	// Ciphers offered, in order; nil means DefaultCiphers.
	Ciphers []string
}

// DefaultCiphers are offered by default. Clients pick by their own order,
// so the offer is what steers: Go's AES-GCM runs on AES-NI, while its
// chacha20-poly1305 (OpenSSH's first choice) forwards at 0.4x OpenSSH's
// speed and AES-CTR at 0.67x. Every OpenSSH since 6.2, PuTTY 0.76+ and
// x/crypto speak GCM; `dstack-runner start --ssh-ciphers` widens the offer
// for older clients (the kill switch).
var DefaultCiphers = []string{"aes128-gcm@openssh.com", "aes256-gcm@openssh.com"}

// Server is the SSH server.
type Server struct {
	cfg   Config
	keys  *KeySet
	srv   *gssh.Server
	conns atomic.Int64
}

// KeySet is the shared authorized keys: --ssh-authorized-key values and the
// job's multi-node key. Safe for concurrent use.
type KeySet struct {
	mu   sync.RWMutex // guards keys
	keys []gossh.PublicKey
}

// Add parses and adds authorized_keys lines; bad lines are errors.
func (k *KeySet) Add(lines ...string) error {
	for _, l := range lines {
		l = strings.TrimSpace(l)
		if l == "" {
			continue
		}
		pk, _, _, _, err := gossh.ParseAuthorizedKey([]byte(l))
		if err != nil {
			return fmt.Errorf("authorized key %.40q: %w", l, err)
		}
		k.mu.Lock()
		k.keys = append(k.keys, pk)
		k.mu.Unlock()
	}
	return nil
}

func (k *KeySet) has(key gossh.PublicKey) bool {
	k.mu.RLock()
	defer k.mu.RUnlock()
	return slices.ContainsFunc(k.keys, func(p gossh.PublicKey) bool { return gssh.KeysEqual(p, key) })
}

// New prepares the server (host keys, handlers) without listening.
func New(cfg Config, keys *KeySet) (*Server, error) {
	if cfg.MaxConns == 0 {
		cfg.MaxConns = 256
	}
	if cfg.KeepAlive == 0 {
		cfg.KeepAlive = 30 * time.Second
	}
	if cfg.KeepAliveMax == 0 {
		cfg.KeepAliveMax = 4
	}
	if cfg.MaxChannels == 0 {
		cfg.MaxChannels = 512
	}
	if cfg.Tracker == nil {
		cfg.Tracker = NewTracker()
	}
	signers, err := hostKeys(cfg.HostKeyDir)
	if err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, keys: keys}
	fwd := &gssh.ForwardedTCPHandler{}
	sl := &streamLocal{log: cfg.Log}
	s.srv = &gssh.Server{
		Addr:                          cfg.Addr,
		HostSigners:                   signers,
		Version:                       "tandem",
		Handler:                       s.session,
		PublicKeyHandler:              s.auth,
		ConnCallback:                  s.onConn,
		LocalPortForwardingCallback:   func(gssh.Context, string, uint32) bool { return true },
		ReversePortForwardingCallback: func(gssh.Context, string, uint32) bool { return true },
		ChannelHandlers: map[string]gssh.ChannelHandler{
			"session":                        s.channel(gssh.DefaultSessionHandler),
			"direct-tcpip":                   s.channel(directTCPIP),
			"direct-streamlocal@openssh.com": s.channel(sl.direct),
		},
		RequestHandlers: map[string]gssh.RequestHandler{
			"tcpip-forward":                          fwd.HandleSSHRequest,
			"cancel-tcpip-forward":                   fwd.HandleSSHRequest,
			"streamlocal-forward@openssh.com":        sl.forward,
			"cancel-streamlocal-forward@openssh.com": sl.cancel,
		},
		SubsystemHandlers: map[string]gssh.SubsystemHandler{"sftp": s.sftp},
		ServerConfigCallback: func(gssh.Context) *gossh.ServerConfig {
			c := &gossh.ServerConfig{}
			c.Ciphers = cfg.Ciphers
			if c.Ciphers == nil {
				c.Ciphers = DefaultCiphers
			}
			return c
		},
		ConnectionFailedCallback: func(c net.Conn, err error) {
			cfg.Log.Debug("ssh connection failed", "remote", c.RemoteAddr().String(), "err", err)
		},
	}
	return s, nil
}

// Serve accepts connections on ln until Close.
func (s *Server) Serve(ln net.Listener) error {
	err := s.srv.Serve(ln)
	if errors.Is(err, gssh.ErrServerClosed) {
		return nil
	}
	return err
}

// Close stops the server and drops its connections.
func (s *Server) Close() error { return s.srv.Close() }

// Tracker returns the connection tracker.
func (s *Server) Tracker() *Tracker { return s.cfg.Tracker }

// onConn caps concurrent connections and tracks their lifetimes.
func (s *Server) onConn(ctx gssh.Context, c net.Conn) net.Conn {
	if n := s.conns.Add(1); n > int64(s.cfg.MaxConns) {
		s.conns.Add(-1)
		s.cfg.Log.Warn("ssh connection refused: too many connections", "remote", c.RemoteAddr().String(), "max", s.cfg.MaxConns)
		c.Close()
		return c
	}
	id := s.cfg.Tracker.Opened(time.Now())
	return &trackedConn{Conn: c, done: func() {
		s.conns.Add(-1)
		s.cfg.Tracker.Closed(id, time.Now())
	}}
}

type trackedConn struct {
	net.Conn
	once sync.Once
	done func()
}

func (c *trackedConn) Close() error {
	c.once.Do(c.done)
	return c.Conn.Close()
}

// auth accepts the shared keys and the target user's own authorized_keys.
func (s *Server) auth(ctx gssh.Context, key gssh.PublicKey) bool {
	if s.keys.has(key) {
		return true
	}
	if l, err := s.cfg.Accounts.Login(ctx.User()); err == nil && l.Home != "/" {
		if b, err := os.ReadFile(filepath.Join(l.Home, ".ssh", "authorized_keys")); err == nil {
			for len(b) > 0 {
				pk, _, _, rest, err := gossh.ParseAuthorizedKey(b)
				if err != nil {
					break
				}
				if gssh.KeysEqual(pk, key) {
					return true
				}
				b = rest
			}
		}
	}
	s.cfg.Log.Info("ssh auth refused", "user", ctx.User(), "remote", ctx.RemoteAddr().String(), "key", gossh.FingerprintSHA256(key))
	return false
}

type connStateKey struct{}

// connState is per-connection bookkeeping kept in the connection's context.
type connState struct {
	channels atomic.Int64
}

// channel wraps a channel handler: the first channel of a connection starts
// keep-alive probes (clients that stop answering are dropped, like
// OpenSSH's ClientAliveInterval/CountMax), and each connection may hold at
// most MaxChannels channels at once.
func (s *Server) channel(h gssh.ChannelHandler) gssh.ChannelHandler {
	return func(srv *gssh.Server, conn *gossh.ServerConn, ch gossh.NewChannel, ctx gssh.Context) {
		ctx.Lock()
		st, ok := ctx.Value(connStateKey{}).(*connState)
		if !ok {
			st = &connState{}
			ctx.SetValue(connStateKey{}, st)
		}
		ctx.Unlock()
		if !ok {
			go s.probe(ctx, conn)
		}
		if n := st.channels.Add(1); n > int64(s.cfg.MaxChannels) {
			st.channels.Add(-1)
			_ = ch.Reject(gossh.ResourceShortage, fmt.Sprintf("too many channels (max %d)", s.cfg.MaxChannels))
			return
		}
		defer st.channels.Add(-1)
		h(srv, conn, ch, ctx)
	}
}

func (s *Server) probe(ctx context.Context, conn *gossh.ServerConn) {
	t := time.NewTicker(s.cfg.KeepAlive)
	defer t.Stop()
	missed := 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			res := make(chan error, 1)
			go func() { _, _, err := conn.SendRequest("keepalive@openssh.com", true, nil); res <- err }()
			select {
			case err := <-res:
				if err != nil {
					return
				}
				missed = 0
			case <-time.After(s.cfg.KeepAlive):
				missed++
				if missed >= s.cfg.KeepAliveMax {
					s.cfg.Log.Info("ssh client stopped answering; dropping it", "remote", conn.RemoteAddr().String())
					conn.Close()
					return
				}
			case <-ctx.Done():
				return
			}
		}
	}
}

// hostKeys loads ed25519 and ECDSA host keys from dir, creating them once.
func hostKeys(dir string) ([]gssh.Signer, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("host key dir: %w", err)
	}
	var out []gssh.Signer
	for _, kind := range []string{"ed25519", "ecdsa"} {
		path := filepath.Join(dir, "ssh_host_"+kind+"_key")
		b, err := os.ReadFile(path)
		if errors.Is(err, os.ErrNotExist) {
			var priv any
			if kind == "ed25519" {
				_, priv, err = ed25519.GenerateKey(rand.Reader)
			} else {
				priv, err = ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
			}
			if err != nil {
				return nil, fmt.Errorf("generate %s host key: %w", kind, err)
			}
			blk, err := gossh.MarshalPrivateKey(priv, "")
			if err != nil {
				return nil, fmt.Errorf("encode %s host key: %w", kind, err)
			}
			b = pem.EncodeToMemory(blk)
			if err := atomicfile.WriteBytes(path, b, atomicfile.Options{Perm: 0o600, UID: -1}); err != nil {
				return nil, fmt.Errorf("host key: %w", err)
			}
		} else if err != nil {
			return nil, fmt.Errorf("read host key: %w", err)
		}
		signer, err := gossh.ParsePrivateKey(b)
		if err != nil {
			return nil, fmt.Errorf("parse host key %s: %w", path, err)
		}
		out = append(out, signer)
	}
	return out, nil
}
