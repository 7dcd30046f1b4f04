// Package agent wires dstack-runner together and runs its lifecycle: wait
// for a job (5 minutes), run it, wait until its logs are read (5 minutes at
// most), exit.
package agent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/httpapi"
	"github.com/tandem-run/tandem/common/lifecycle"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/common/sockdiag"
	"github.com/tandem-run/tandem/common/version"
	"github.com/tandem-run/tandem/runner/account"
	"github.com/tandem-run/tandem/runner/executor"
	"github.com/tandem-run/tandem/runner/metrics"
	"github.com/tandem-run/tandem/runner/server"
	"github.com/tandem-run/tandem/runner/sshd"
)

// Config is the runner's one configuration: its own settings, and its
// components' configs as the flags set them (the executor's limits and
// graces, the SSH server's limits, policy and ciphers). Run adds only what
// it alone knows (paths, accounts, credentials) to those, never copies
// them field by field.
type Config struct {
	LogLevel       slog.Level
	LogFormat      logging.Format
	TempDir        string
	HTTPAddress    string
	HTTPPort       int
	SSHPort        int
	SSHAddress     string
	AuthorizedKeys []string
	// SSHLogLevel is the SSH server's own level (dstack's --ssh-log-level),
	// apart from the runner's.
	SSHLogLevel  slog.Level
	DstackDir    string
	StartTimeout time.Duration
	LogsWait     time.Duration
	// Linger keeps the runner up this long after the logs were pulled, for
	// late readers (a CLI attaching over WebSocket, a retried pull).
	Linger time.Duration
	Stdout io.Writer

	// APIUIDs, when set, are the only uids whose local sockets the HTTP
	// API serves (the shim passes its root-equivalent accounts to a
	// host-network runner, whose port is on the host's loopback); nil
	// serves every client.
	APIUIDs []uint32
	// TaskID is the shim task this runner serves, said in its healthcheck.
	TaskID string

	Executor executor.Config
	SSH      sshd.Config
	Metrics  metrics.Config
}

// Defaults are the runner's defaults, its components' included: the flags
// show and use them, and Run fills a zero field from them (WithDefaults).
func Defaults() Config {
	return Config{
		LogLevel:     slog.LevelInfo,
		LogFormat:    logging.FormatText,
		TempDir:      "/tmp/runner",
		HTTPPort:     api.RunnerHTTPPort,
		SSHPort:      api.RunnerSSHPort,
		SSHLogLevel:  slog.LevelInfo,
		DstackDir:    "/dstack",
		StartTimeout: 5 * time.Minute,
		LogsWait:     5 * time.Minute,
		Linger:       10 * time.Second,
		Executor:     executor.Defaults(),
		SSH:          sshd.Defaults(),
		Metrics:      metrics.Defaults(),
	}
}

// WithDefaults returns c with its zero fields taken from Defaults (the
// components fill their own in their constructors).
func (c Config) WithDefaults() Config {
	d := Defaults()
	c.TempDir = cmp.Or(c.TempDir, d.TempDir)
	c.HTTPPort = cmp.Or(c.HTTPPort, d.HTTPPort)
	c.SSHPort = cmp.Or(c.SSHPort, d.SSHPort)
	c.DstackDir = cmp.Or(c.DstackDir, d.DstackDir)
	c.StartTimeout = cmp.Or(c.StartTimeout, d.StartTimeout)
	c.LogsWait = cmp.Or(c.LogsWait, d.LogsWait)
	if c.Stdout == nil {
		c.Stdout = os.Stdout
	}
	return c
}

// ErrNoJob is returned when no job arrived in time or a signal came first.
var ErrNoJob = errors.New("no job submitted")

// Run runs the runner until the job is done and its logs were read.
func Run(ctx context.Context, cfg Config) error {
	a := &agent{cfg: cfg.WithDefaults()}
	defer a.Stop()
	if err := a.Start(ctx,
		lifecycle.Step{Name: "log", Start: a.startLog},
		lifecycle.Step{Name: "host", Start: a.startHost},
		lifecycle.Step{Name: "executor", Start: a.startExecutor},
		// The SSH port is bound before the API answers, so a healthy
		// runner never refuses an SSH connection (it waits in the
		// backlog); the SSH server itself comes after the API, which the
		// server's healthcheck waits for.
		lifecycle.Step{Name: "ssh-port", Start: a.bindSSH},
		lifecycle.Step{Name: "api", Start: a.startAPI},
		lifecycle.Step{Name: "ssh", Start: a.startSSH},
	); err != nil {
		return err
	}
	return a.lifecycle(ctx)
}

// agent is the running runner. Its parts start in order, each from what
// the ones before made, and stop in reverse (lifecycle.Stack).
type agent struct {
	cfg  Config
	base *slog.Logger // every level (the SSH server's may be lower)
	log  *slog.Logger // the runner's level

	accounts account.Accounts
	uid      int
	canSet   bool // the runner may switch users
	keys     *sshd.KeySet
	tracker  *sshd.Tracker
	sshLn    net.Listener // bound by bindSSH, served by startSSH
	x        *executor.Executor

	lifecycle.Stack // what started, stopped in reverse by Run
}

func (a *agent) startLog(context.Context) error {
	base, logf, err := logging.ToFile(min(a.cfg.LogLevel, a.cfg.SSHLogLevel), a.cfg.LogFormat, a.cfg.Stdout, filepath.Join(a.cfg.TempDir, "default.log"))
	if err != nil {
		return err
	}
	a.OnStop(func() { logf.Close() })
	a.base, a.log = base, logging.AtLevel(base, a.cfg.LogLevel)
	a.log.Info("dstack-runner starting", "version", version.String(), "tandem_version", version.Tandem(), "temp_dir", a.cfg.TempDir)
	return nil
}

// startHost learns the runner's user and what it may do, and prepares the
// dstack dir.
func (a *agent) startHost(context.Context) error {
	a.uid, a.accounts = os.Geteuid(), account.Accounts{Root: "/"}
	home := homeOf(a.accounts, a.uid)
	if os.Getenv("HOME") != home {
		a.log.Warn("HOME does not match the passwd entry; fixing", "home", home)
		_ = os.Setenv("HOME", home)
	}
	if err := prepareDstackDir(a.cfg.DstackDir); err != nil {
		a.log.Warn("prepare dstack dir", "dir", a.cfg.DstackDir, "err", err)
	}
	a.canSet = a.uid == 0 && hasCaps("/proc/self/status", 0, 6, 7) // CHOWN, SETGID, SETUID
	if !a.canSet {
		a.log.Info("runner cannot switch users; jobs run as the runner's user", "uid", a.uid)
	}
	a.keys, a.tracker = &sshd.KeySet{}, sshd.NewTracker()
	for _, k := range a.cfg.AuthorizedKeys {
		if err := a.keys.Add(k); err != nil {
			a.log.Warn("ignoring an authorized key", "err", err)
		}
	}
	return nil
}

// startExecutor makes the executor: the limits and graces come from the
// flags, the rest is this runner's.
func (a *agent) startExecutor(context.Context) error {
	xc := a.cfg.Executor
	xc.TempDir, xc.Paths = a.cfg.TempDir, executor.Paths{DstackDir: a.cfg.DstackDir, EtcProfile: "/etc/profile"}
	xc.Accounts, xc.SelfUID, xc.CanSetUser, xc.BaseEnv = a.accounts, a.uid, a.canSet, os.Environ()
	xc.Log, xc.Stdout, xc.Connections, xc.SSHPort = a.log, a.cfg.Stdout, a.tracker, a.cfg.SSHPort
	xc.AuthorizeKey = func(line string) error { return a.keys.Add(line) }
	x, err := executor.New(xc)
	if err != nil {
		return err
	}
	a.x = x
	a.OnStop(func() { x.Close() })
	return nil
}

// bindSSH binds the SSH port.
func (a *agent) bindSSH(context.Context) error {
	ln, err := listen(net.JoinHostPort(a.cfg.SSHAddress, strconv.Itoa(a.cfg.SSHPort)))
	if err != nil {
		return fmt.Errorf("ssh listen :%d: %w", a.cfg.SSHPort, err)
	}
	a.sshLn = ln
	a.OnStop(func() { ln.Close() })
	return nil
}

// startSSH serves SSH on the bound port: the limits, policy and ciphers come from the flags;
// sessions start from the executor's environment.
func (a *agent) startSSH(context.Context) error {
	self, err := os.Executable()
	if err != nil {
		self = api.RunnerBinaryInContainer
	}
	sc := a.cfg.SSH
	sc.HostKeyDir, sc.Accounts, sc.Env = filepath.Join(a.cfg.TempDir, "ssh"), a.accounts, a.x.SessionEnv
	sc.PublicKeysFile = filepath.Join(a.cfg.TempDir, api.RunnerHostKeysFile)
	sc.CanSetUser, sc.Self, sc.Tracker = a.canSet, self, a.tracker
	sc.Log = logging.AtLevel(a.base, a.cfg.SSHLogLevel)
	srv, err := sshd.New(sc, a.keys)
	if err != nil {
		return fmt.Errorf("ssh server: %w", err)
	}
	ln := a.sshLn
	go func() {
		if err := srv.Serve(ln); err != nil {
			a.log.Error("ssh server stopped", "err", err)
		}
	}()
	// The keys reach the disk once the server serves: their fsyncs are off
	// the first login's path.
	go func() {
		if err := srv.SaveKeys(); err != nil {
			a.log.Error("ssh host keys not saved; the next start makes new ones", "err", err)
		}
	}()
	a.OnStop(func() { srv.Close() })
	a.log.Info("ssh server serving", "addr", ln.Addr().String(), "authorized_keys", len(a.cfg.AuthorizedKeys))
	return nil
}

// startAPI serves the runner's HTTP API.
func (a *agent) startAPI(context.Context) error {
	e := server.New(server.Deps{Version: version.String(), TandemVersion: version.Tandem(), TaskID: a.cfg.TaskID, Executor: a.x, Metrics: metrics.New(a.cfg.Metrics, a.log, nil), Log: a.log})
	addr := net.JoinHostPort(a.cfg.HTTPAddress, strconv.Itoa(a.cfg.HTTPPort))
	ln, err := listen(addr)
	if err != nil {
		return fmt.Errorf("listen %s: %w", addr, err)
	}
	hs := httpapi.NewServer(e, httpapi.DefaultLimits)
	var admit httpapi.Admit
	if a.cfg.APIUIDs != nil {
		admit = uidAdmit(a.cfg.APIUIDs)
		a.log.Info("runner API serves only these local uids", "uids", a.cfg.APIUIDs)
	}
	gate := httpapi.NewGate(ln, httpapi.DefaultLimits, admit, a.log)
	gate.Attach(hs)
	go func() { _ = hs.Serve(gate) }()
	a.OnStop(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = hs.Shutdown(sctx)
	})
	a.log.Info("runner API serving", "addr", gate.Addr().String())
	return nil
}

// lifecycle waits for a job (StartTimeout), for its end, and for its logs
// to be read (LogsWait at most), then lingers for late readers.
func (a *agent) lifecycle(ctx context.Context) error {
	cfg, x, log := a.cfg, a.x, a.log
	select {
	case <-x.Started():
	case <-time.After(cfg.StartTimeout):
		log.Error("Job didn't start in time", "timeout", cfg.StartTimeout)
		return ErrNoJob
	case <-ctx.Done():
		log.Error("signal before a job started")
		return ErrNoJob
	}
	select {
	case <-x.Finished():
	case <-ctx.Done():
		log.Info("signal: stopping the job")
		x.Stop()
	}
	if x.NoPull() {
		// Nobody will pull (a detached tandem run): the followers get the
		// end, a polling attach gets a moment to read the final state, and
		// the ports go back at once. The shim keeps the output.
		a.noPullExit(ctx)
		return nil
	}
	// Wait for the logs to be read. A signal now means the container is
	// being stopped: whoever wanted the logs has had its chance.
	deadline := time.After(cfg.LogsWait)
	select {
	case <-x.PullConsumed():
	case <-deadline:
		log.Warn("logs were not pulled before the deadline")
		return nil
	case <-ctx.Done():
		return nil
	}
	select {
	case <-time.After(cfg.Linger):
	case <-deadline:
	case <-ctx.Done():
		return nil
	}
	select {
	case <-x.Streamers().Idle():
	case <-deadline:
		log.Warn("log streamers did not finish before the deadline")
	case <-ctx.Done():
	}
	log.Info("dstack-runner done")
	return nil
}

// noPullExit waits, after the job's end, for its WebSocket followers and a
// pull in flight (0.5 s), when no reader is expected, then for followers
// that came meanwhile (an attach opens its stream beside its state pull,
// and the final state's pull must not cut the stream it opened): 5 s at
// most in all.
func (a *agent) noPullExit(ctx context.Context) {
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	followers := func() bool {
		select {
		case <-a.x.Streamers().Idle():
			return true
		case <-wctx.Done():
			return false
		}
	}
	if !followers() {
		return
	}
	select {
	case <-a.x.PullConsumed():
	case <-time.After(500 * time.Millisecond):
	case <-wctx.Done():
		return
	}
	if followers() {
		a.log.Info("dstack-runner done: no reader expected; the shim keeps the output")
	}
}

// listen listens on addr, waiting up to bindWait while the port is taken:
// the runner of a task that just ended may still be leaving it.
func listen(addr string) (net.Listener, error) {
	// localhost is the loopback (RFC 6761): listened on without reading
	// the resolver's files (resolv.conf, nsswitch.conf, hosts: 1-3 ms of
	// every start).
	if host, port, err := net.SplitHostPort(addr); err == nil && strings.EqualFold(host, "localhost") {
		addr = net.JoinHostPort("127.0.0.1", port)
	}
	deadline := time.Now().Add(bindWait)
	for {
		ln, err := net.Listen("tcp", addr)
		if err == nil || !errors.Is(err, syscall.EADDRINUSE) || time.Now().After(deadline) {
			return ln, err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// bindWait is how long a taken port is waited for at start.
const bindWait = 3 * time.Second

func homeOf(accounts account.Accounts, uid int) string {
	if h := accounts.HomeOf(uid); h != "" {
		return h
	}
	if uid == 0 {
		return "/root"
	}
	return "/"
}

func prepareDstackDir(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	_ = os.Chown(dir, 0, 0)
	return os.Chmod(dir, 0o755)
}

// hasCaps reports whether the effective capability set has every bit.
func hasCaps(statusPath string, bits ...uint) bool {
	b, err := os.ReadFile(statusPath)
	if err != nil {
		return false
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "CapEff:"); ok {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				return false
			}
			for _, bit := range bits {
				if n&(1<<bit) == 0 {
					return false
				}
			}
			return true
		}
	}
	return false
}

// uidAdmit admits the connections whose client socket, found in this
// network namespace's tables, is owned by one of uids; any other, or one
// not found, is refused with a 403 naming it.
func uidAdmit(uids []uint32) httpapi.Admit {
	return func(conns []net.Conn) []httpapi.Admission {
		look := sockdiag.Open("")
		defer look.Close()
		out := make([]httpapi.Admission, len(conns))
		for i, c := range conns {
			peer := c.RemoteAddr().String()
			l, ok1 := c.LocalAddr().(*net.TCPAddr)
			r, ok2 := c.RemoteAddr().(*net.TCPAddr)
			if !ok1 || !ok2 {
				out[i] = httpapi.Admission{Refuse: true, Peer: peer, Reason: "not a TCP connection"}
				continue
			}
			_, uid, err := look.Find(l, r)
			switch {
			case err != nil:
				out[i] = httpapi.Admission{Refuse: true, Peer: peer, Reason: err.Error(),
					Message: "this runner serves only the host's root-equivalent accounts; the caller " + peer + " was not found: " + err.Error()}
			case !slices.Contains(uids, uid):
				out[i] = httpapi.Admission{Refuse: true, Peer: peer + " uid " + strconv.FormatUint(uint64(uid), 10), Reason: "uid not root-equivalent",
					Message: "this runner serves only the host's root-equivalent accounts, not uid " + strconv.FormatUint(uint64(uid), 10) + " (" + peer + ")"}
			default:
				out[i] = httpapi.Admission{Trusted: true, Peer: peer}
			}
		}
		return out
	}
}
