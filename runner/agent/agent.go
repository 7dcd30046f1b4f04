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
	"strconv"
	"strings"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/httpapi"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/common/version"
	"github.com/tandem-run/tandem/runner/account"
	"github.com/tandem-run/tandem/runner/executor"
	"github.com/tandem-run/tandem/runner/metrics"
	"github.com/tandem-run/tandem/runner/server"
	"github.com/tandem-run/tandem/runner/sshd"
)

// Config is the runner's configuration.
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

	Executor executor.Config
	SSH      sshd.Config
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
	cfg = cfg.WithDefaults()
	base, logf, err := logging.ToFile(min(cfg.LogLevel, cfg.SSHLogLevel), cfg.LogFormat, cfg.Stdout, filepath.Join(cfg.TempDir, "default.log"))
	if err != nil {
		return err
	}
	defer logf.Close()
	log := logging.AtLevel(base, cfg.LogLevel)
	log.Info("dstack-runner starting", "version", version.String(), "tandem_version", version.Tandem(), "temp_dir", cfg.TempDir)

	uid := os.Geteuid()
	accounts := account.Accounts{Root: "/"}
	home := homeOf(accounts, uid)
	if os.Getenv("HOME") != home {
		log.Warn("HOME does not match the passwd entry; fixing", "home", home)
		_ = os.Setenv("HOME", home)
	}
	if err := prepareDstackDir(cfg.DstackDir); err != nil {
		log.Warn("prepare dstack dir", "dir", cfg.DstackDir, "err", err)
	}
	canSet := uid == 0 && hasCaps("/proc/self/status", 0, 6, 7) // CHOWN, SETGID, SETUID
	if !canSet {
		log.Info("runner cannot switch users; jobs run as the runner's user", "uid", uid)
	}
	keys := &sshd.KeySet{}
	for _, k := range cfg.AuthorizedKeys {
		if err := keys.Add(k); err != nil {
			log.Warn("ignoring an authorized key", "err", err)
		}
	}
	tracker := sshd.NewTracker()
	self, err := os.Executable()
	if err != nil {
		self = api.RunnerBinaryInContainer
	}
	var x *executor.Executor
	// The limits and policy switches come from the flags; the rest is
	// this runner's.
	sc := cfg.SSH
	sc.HostKeyDir = filepath.Join(cfg.TempDir, "ssh")
	sc.Accounts = accounts
	sc.Env = func() []string { return x.SessionEnv() }
	sc.CanSetUser, sc.Self, sc.Tracker = canSet, self, tracker
	sc.Log = logging.AtLevel(base, cfg.SSHLogLevel)
	sshSrv, err := sshd.New(sc, keys)
	if err != nil {
		return fmt.Errorf("ssh server: %w", err)
	}
	// The same for the executor.
	xc := cfg.Executor
	xc.TempDir, xc.Paths = cfg.TempDir, executor.Paths{DstackDir: cfg.DstackDir, EtcProfile: "/etc/profile"}
	xc.Accounts, xc.SelfUID, xc.CanSetUser, xc.BaseEnv = accounts, uid, canSet, os.Environ()
	xc.Log, xc.Stdout, xc.Connections, xc.SSHPort = log, cfg.Stdout, tracker, cfg.SSHPort
	xc.AuthorizeKey = func(line string) error { return keys.Add(line) }
	x, err = executor.New(xc)
	if err != nil {
		return err
	}
	defer x.Close()
	// SSH serves only now: a session's environment comes from the executor.
	sshLn, err := net.Listen("tcp", net.JoinHostPort(cfg.SSHAddress, strconv.Itoa(cfg.SSHPort)))
	if err != nil {
		return fmt.Errorf("ssh listen :%d: %w", cfg.SSHPort, err)
	}
	go func() {
		if err := sshSrv.Serve(sshLn); err != nil {
			log.Error("ssh server stopped", "err", err)
		}
	}()
	defer sshSrv.Close()
	log.Info("ssh server serving", "addr", sshLn.Addr().String(), "authorized_keys", len(cfg.AuthorizedKeys))

	e := server.New(server.Deps{Version: version.String(), TandemVersion: version.Tandem(), Executor: x, Metrics: metrics.Collector{}, Log: log})
	addr := net.JoinHostPort(cfg.HTTPAddress, strconv.Itoa(cfg.HTTPPort))
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("listen %s: %w", addr, err)
	}
	hs := httpapi.NewServer(e, httpapi.DefaultLimits)
	gate := httpapi.NewGate(ln, httpapi.DefaultLimits, nil, log)
	gate.Attach(hs)
	go func() { _ = hs.Serve(gate) }()
	log.Info("runner API serving", "addr", gate.Addr().String())
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = hs.Shutdown(sctx)
	}()

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
	done := make(chan struct{})
	go func() { x.Streamers().Wait(); close(done) }()
	select {
	case <-done:
	case <-deadline:
		log.Warn("log streamers did not finish before the deadline")
	case <-ctx.Done():
	}
	log.Info("dstack-runner done")
	return nil
}

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
