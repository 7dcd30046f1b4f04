// Package sshd is the runner's embedded SSH server: any image becomes
// reachable without OpenSSH. It authenticates with public keys only, runs
// sessions and sftp as the login user, and forwards TCP ports, Unix sockets
// and the client's agent.
package sshd

import (
	"cmp"
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
	"time"

	gssh "github.com/gliderlabs/ssh"
	gossh "golang.org/x/crypto/ssh"

	"github.com/tandem-run/tandem/common/atomicfile"
	"github.com/tandem-run/tandem/common/rawnet"
	"github.com/tandem-run/tandem/runner/account"
)

// Config is how the server runs.
type Config struct {
	Addr       string
	HostKeyDir string // host keys are created here once and reused
	// PublicKeysFile, when set, receives the host public keys, one
	// authorized_keys line each (the shim reports them to clients).
	PublicKeysFile string
	Accounts       account.Accounts
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
	// LoginGrace bounds a connection's time to authenticate (30 s);
	// MaxStartups caps unauthenticated connections (32), PerSource those
	// from one address (8). See gate.
	LoginGrace  time.Duration
	MaxStartups int
	PerSource   int
	// GatewayPorts lets -R listen on addresses other than loopback.
	GatewayPorts bool
	// PermitUserEnvironment applies authorized_keys environment= options.
	PermitUserEnvironment bool
	Now                   func() time.Time
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
	cfg  Config
	keys *KeySet
	srv  *gssh.Server
	gate *gate
	// ahead holds the connections' read-ahead buffers, behind their
	// write-behind ones (see rawnet.WrapBuffered).
	ahead, behind *rawnet.Buffers
	// signers are the host keys; newKeys, those New had to make, are
	// written by SaveKeys.
	signers []gssh.Signer
	newKeys []keyFile
}

// Each SSH connection reads up to readAheadBuf per system call from one of
// maxReadAheadBufs shared buffers (4 MiB), held only while it holds unread
// data (see rawnet.WrapBuffered).
const (
	readAheadBuf     = 256 << 10
	maxReadAheadBufs = 16
)

// Each SSH connection writes up to writeBehindBuf per system call from
// maxWriteBehindBufs shared buffers (8 MiB; a bulk stream holds two: one
// being written, one filling), held only while data waits to go out.
const (
	writeBehindBuf     = 256 << 10
	maxWriteBehindBufs = 32
)

// authKey is one authorized_keys line: the key and its options.
type authKey struct {
	key     gossh.PublicKey
	options []string
}

// KeySet is the shared authorized keys: --ssh-authorized-key values and the
// job's multi-node key, each with its options. Safe for concurrent use.
type KeySet struct {
	mu   sync.RWMutex // guards keys
	keys []authKey
}

// Add parses and adds authorized_keys lines; bad lines are errors.
func (k *KeySet) Add(lines ...string) error {
	for _, l := range lines {
		l = strings.TrimSpace(l)
		if l == "" {
			continue
		}
		pk, _, opts, _, err := gossh.ParseAuthorizedKey([]byte(l))
		if err != nil {
			return fmt.Errorf("authorized key %.40q: %w", l, err)
		}
		if _, err := parseKeyOptions(opts); err != nil {
			return fmt.Errorf("authorized key %.40q: %w", l, err)
		}
		k.mu.Lock()
		if !slices.ContainsFunc(k.keys, func(a authKey) bool { return gssh.KeysEqual(a.key, pk) && slices.Equal(a.options, opts) }) {
			k.keys = append(k.keys, authKey{key: pk, options: opts})
		}
		k.mu.Unlock()
	}
	return nil
}

func (k *KeySet) matching(key gssh.PublicKey) []authKey {
	k.mu.RLock()
	defer k.mu.RUnlock()
	var out []authKey
	for _, a := range k.keys {
		if gssh.KeysEqual(a.key, key) {
			out = append(out, a)
		}
	}
	return out
}

// Defaults are the SSH server's limits: New fills the zero fields of its
// Config from them (WithDefaults), and the runner's flags show and use the
// same values.
func Defaults() Config {
	return Config{MaxConns: 256, KeepAlive: 30 * time.Second, KeepAliveMax: 4, MaxChannels: 512,
		LoginGrace: 30 * time.Second, MaxStartups: 32, PerSource: 8}
}

// WithDefaults returns c with its zero fields taken from Defaults (and a
// tracker and a clock).
func (c Config) WithDefaults() Config {
	d := Defaults()
	c.MaxConns = cmp.Or(c.MaxConns, d.MaxConns)
	c.KeepAlive = cmp.Or(c.KeepAlive, d.KeepAlive)
	c.KeepAliveMax = cmp.Or(c.KeepAliveMax, d.KeepAliveMax)
	c.MaxChannels = cmp.Or(c.MaxChannels, d.MaxChannels)
	c.LoginGrace = cmp.Or(c.LoginGrace, d.LoginGrace)
	c.MaxStartups = cmp.Or(c.MaxStartups, d.MaxStartups)
	c.PerSource = cmp.Or(c.PerSource, d.PerSource)
	if c.Tracker == nil {
		c.Tracker = NewTracker()
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return c
}

// New prepares the server (host keys, handlers) without listening. Keys
// it had to make are in memory only until SaveKeys.
func New(cfg Config, keys *KeySet) (*Server, error) {
	cfg = cfg.WithDefaults()
	signers, newKeys, err := hostKeys(cfg.HostKeyDir)
	if err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, keys: keys, newKeys: newKeys, signers: signers, gate: newGate(cfg.LoginGrace, cfg.MaxStartups, cfg.PerSource, cfg.MaxConns),
		ahead: rawnet.NewBuffers(readAheadBuf, maxReadAheadBufs), behind: rawnet.NewBuffers(writeBehindBuf, maxWriteBehindBufs)}
	fw := &forwards{s: s, log: cfg.Log, cp: newCopier(maxBigCopyBufs)}
	s.srv = &gssh.Server{
		Addr:                          cfg.Addr,
		HostSigners:                   signers,
		Version:                       "tandem",
		Handler:                       s.session,
		PublicKeyHandler:              s.auth,
		ConnCallback:                  s.onConn,
		PtyCallback:                   func(ctx gssh.Context, _ gssh.Pty) bool { return !s.grant(ctx).noPty },
		LocalPortForwardingCallback:   func(gssh.Context, string, uint32) bool { return false }, // ours below
		ReversePortForwardingCallback: func(gssh.Context, string, uint32) bool { return false },
		ChannelHandlers: map[string]gssh.ChannelHandler{
			"session":                        s.channel(gssh.DefaultSessionHandler),
			"direct-tcpip":                   s.channel(fw.directTCP),
			"direct-streamlocal@openssh.com": s.channel(fw.directUnix),
		},
		RequestHandlers: map[string]gssh.RequestHandler{
			"tcpip-forward":                          fw.listenTCP,
			"cancel-tcpip-forward":                   fw.cancelTCP,
			"streamlocal-forward@openssh.com":        fw.listenUnix,
			"cancel-streamlocal-forward@openssh.com": fw.cancelUnix,
		},
		SubsystemHandlers: map[string]gssh.SubsystemHandler{"sftp": s.sftp},
		ServerConfigCallback: func(gssh.Context) *gossh.ServerConfig {
			c := &gossh.ServerConfig{}
			c.Ciphers = cfg.Ciphers
			if c.Ciphers == nil {
				c.Ciphers = DefaultCiphers
			}
			// Called after each authentication attempt; nil err is a real
			// success (a signature checked), unlike the key callback, which
			// also answers queries.
			c.AuthLogCallback = func(md gossh.ConnMetadata, method string, err error) {
				if err == nil {
					s.authenticated(md)
				}
			}
			return c
		},
		ConnectionFailedCallback: func(c net.Conn, err error) {
			cfg.Log.Debug("ssh connection failed", "remote", c.RemoteAddr().String(), "err", err)
		},
	}
	return s, nil
}

// SaveKeys writes the host keys New made (each atomically, fsynced) and
// then PublicKeysFile. It is meant to run once the server listens: the
// three fsyncs took ~15 ms of every first login's path on a slow disk, and
// a runner that dies before they land only makes new keys next time, as
// on its first start.
func (s *Server) SaveKeys() error {
	if err := saveKeyFiles(s.newKeys); err != nil {
		return err
	}
	if s.cfg.PublicKeysFile == "" {
		return nil
	}
	var b []byte
	for _, sg := range s.signers {
		b = append(b, gossh.MarshalAuthorizedKey(sg.PublicKey())...)
	}
	if err := atomicfile.WriteBytes(s.cfg.PublicKeysFile, b, atomicfile.Options{Perm: 0o644, UID: -1}); err != nil {
		return fmt.Errorf("host public keys: %w", err)
	}
	return nil
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

// onConn admits a new connection into the login window (see gate); the
// oldest unauthenticated connections past the caps are dropped.
func (s *Server) onConn(_ gssh.Context, c net.Conn) net.Conn {
	gc, evicted := s.gate.admit(rawnet.WrapBuffered(c, s.ahead, s.behind))
	for _, e := range evicted {
		s.cfg.Log.Info("ssh: dropping an unauthenticated connection to make room", "remote", e.RemoteAddr().String())
		e.Close()
	}
	return gc
}

// authenticated ends the connection's login window and starts tracking it
// for no_connections_secs; past MaxConns it is dropped.
func (s *Server) authenticated(md gossh.ConnMetadata) {
	gc, ok := s.gate.authenticated(md.RemoteAddr(), func() func() {
		id := s.cfg.Tracker.Opened(s.cfg.Now())
		return func() { s.cfg.Tracker.Closed(id, s.cfg.Now()) }
	})
	if gc != nil && !ok {
		s.cfg.Log.Warn("ssh connection refused: too many connections", "remote", md.RemoteAddr().String(), "max", s.cfg.MaxConns)
		gc.Close()
	}
}

// permKey names the fingerprint in the key's gossh.Permissions.
const permKey = "tandem-key-fp"

// auth accepts a key listed in the shared keys or the target user's
// authorized_keys, with OpenSSH's option semantics: a line whose options we
// do not implement, that expired, or whose from= does not match is skipped.
// What the key grants is recorded per key: the options in force are those
// of the key that actually signed (grant), not of the last key offered.
func (s *Server) auth(ctx gssh.Context, key gssh.PublicKey) bool {
	fp := gossh.FingerprintSHA256(key)
	log := s.cfg.Log.With("user", ctx.User(), "remote", ctx.RemoteAddr().String(), "key", fp)
	candidates := s.keys.matching(key)
	if l, err := s.login(ctx); err == nil && l.Home != "/" {
		candidates = append(candidates, userKeys(l.Home, key)...)
	}
	for _, c := range candidates {
		opts, err := parseKeyOptions(c.options)
		if err != nil {
			log.Warn("ssh key line refused", "err", err)
			continue
		}
		if ok, why := opts.admits(s.cfg.Now(), ctx.RemoteAddr()); !ok {
			log.Info("ssh key line refused", "why", why)
			continue
		}
		c := connOf(ctx)
		c.mu.Lock()
		if _, seen := c.grants[fp]; !seen {
			c.grants[fp] = opts
		}
		c.mu.Unlock()
		// A fresh Permissions per key: x/crypto caches it with the key,
		// so the connection ends up holding the signing key's.
		ctx.SetValue(gssh.ContextKeyPermissions, &gssh.Permissions{Permissions: &gossh.Permissions{Extensions: map[string]string{permKey: fp}}})
		return true
	}
	log.Info("ssh auth refused")
	return false
}

// userKeys are the lines of home's authorized_keys for key.
func userKeys(home string, key gssh.PublicKey) []authKey {
	b, err := os.ReadFile(filepath.Join(home, ".ssh", "authorized_keys"))
	if err != nil {
		return nil
	}
	var out []authKey
	for len(b) > 0 {
		pk, _, opts, rest, err := gossh.ParseAuthorizedKey(b)
		if err != nil {
			break
		}
		if gssh.KeysEqual(pk, key) {
			out = append(out, authKey{key: pk, options: opts})
		}
		b = rest
	}
	return out
}

// login resolves the connection's user once (passwd, groups, shell, home)
// and reuses it for every key tried, session and forward of the
// connection.
func (s *Server) login(ctx gssh.Context) (account.Login, error) {
	c := connOf(ctx)
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.loginDone {
		c.login, c.loginErr = s.cfg.Accounts.Login(ctx.User())
		c.loginDone = true
	}
	return c.login, c.loginErr
}

// grant returns what the connection's authenticated key grants. Anything
// unexpected grants nothing.
func (s *Server) grant(ctx gssh.Context) keyOptions {
	deny := keyOptions{noPortForwarding: true, noPty: true, noAgent: true, hasCommand: true, command: "false"}
	conn, ok := ctx.Value(gssh.ContextKeyConn).(*gossh.ServerConn)
	if !ok || conn.Permissions == nil {
		return deny
	}
	fp := conn.Permissions.Extensions[permKey]
	c := connOf(ctx)
	c.mu.Lock()
	defer c.mu.Unlock()
	opts, ok := c.grants[fp]
	if !ok {
		return deny
	}
	return opts
}

// channel wraps a channel handler: the first channel of a connection starts
// keep-alive probes (clients that stop answering are dropped, like
// OpenSSH's ClientAliveInterval/CountMax), and each connection may hold at
// most MaxChannels channels at once.
func (s *Server) channel(h gssh.ChannelHandler) gssh.ChannelHandler {
	return func(srv *gssh.Server, conn *gossh.ServerConn, ch gossh.NewChannel, ctx gssh.Context) {
		st := connOf(ctx)
		st.mu.Lock()
		first := !st.probing
		st.probing = true
		st.mu.Unlock()
		if first {
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

// keyFile is a host key made in memory, to be written to path.
type keyFile struct {
	path string
	pem  []byte
}

// saveKeyFiles writes each key, atomically and fsynced.
func saveKeyFiles(keys []keyFile) error {
	for _, k := range keys {
		if err := atomicfile.WriteBytes(k.path, k.pem, atomicfile.Options{Perm: 0o600, UID: -1}); err != nil {
			return fmt.Errorf("host key: %w", err)
		}
	}
	return nil
}

// hostKeys loads ed25519 and ECDSA host keys from dir, making those it
// lacks; made are those, for saveKeyFiles (see SaveKeys).
func hostKeys(dir string) (signers []gssh.Signer, made []keyFile, err error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, nil, fmt.Errorf("host key dir: %w", err)
	}
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
				return nil, nil, fmt.Errorf("generate %s host key: %w", kind, err)
			}
			blk, err := gossh.MarshalPrivateKey(priv, "")
			if err != nil {
				return nil, nil, fmt.Errorf("encode %s host key: %w", kind, err)
			}
			b = pem.EncodeToMemory(blk)
			made = append(made, keyFile{path, b})
		} else if err != nil {
			return nil, nil, fmt.Errorf("read host key: %w", err)
		}
		signer, err := gossh.ParsePrivateKey(b)
		if err != nil {
			return nil, nil, fmt.Errorf("parse host key %s: %w", path, err)
		}
		signers = append(signers, signer)
	}
	return signers, made, nil
}
