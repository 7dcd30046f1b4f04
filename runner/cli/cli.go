// Package cli defines dstack-runner's command line, flag for flag with dstack's.
package cli

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"

	"github.com/urfave/cli/v2"

	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/common/version"
	"github.com/tandem-run/tandem/runner/agent"
	"github.com/tandem-run/tandem/runner/logs"
	"github.com/tandem-run/tandem/runner/sshd"
)

// versionVerbose prints the reported version, Tandem's release and the
// toolchain; --version stays the three words the server's parser reads.
const versionVerbose = "version-verbose"

// App returns the dstack-runner command. `--version` prints exactly
// "dstack-runner version <v>": the shim's component manager parses it.
func App() *cli.App { return app(agent.Run) }

// app is the command with start's runner injected (tests capture the
// config the flags make).
func app(run func(context.Context, agent.Config) error) *cli.App {
	d := agent.Defaults()
	return &cli.App{
		Name:    "dstack-runner",
		Usage:   "run one dstack job inside its container",
		Version: version.String(),
		// authorized_keys options contain commas (from="a,b",no-pty): a key
		// must arrive as the one value it is.
		DisableSliceFlagSeparator: true,
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "log-level", Value: d.LogLevel.String(), Usage: "fatal, error, warn, info, debug, trace or 1..6"},
			&cli.StringFlag{Name: "log-format", Value: string(d.LogFormat), EnvVars: []string{"TANDEM_LOG_FORMAT"}, Usage: "text or json (one object per line)"},
			&cli.BoolFlag{Name: versionVerbose, Usage: "print the version, Tandem's release and the Go toolchain"},
		},
		Before: func(c *cli.Context) error {
			if c.Bool(versionVerbose) {
				fmt.Fprint(c.App.Writer, version.Verbose(c.App.Name))
				return cli.Exit("", 0)
			}
			_, err := logging.ParseLevel(c.String("log-level"))
			return err
		},
		Commands: []*cli.Command{{
			Name:   "sftp-server",
			Hidden: true,
			Usage:  "serve sftp on stdin/stdout (started by the SSH server as the login user)",
			Action: func(*cli.Context) error { return sshd.ServeSFTP() },
		}, {
			Name:            sshd.SockHelperCommand,
			Hidden:          true,
			SkipFlagParsing: true,
			Usage:           "open one forwarding socket as the login user and pass it back on fd 3 (started by the SSH server)",
			Action:          func(c *cli.Context) error { return sshd.ServeSockHelper(c.Args().Slice()) },
		}, {
			Name:  "start",
			Usage: "start the runner and wait for a job",
			Flags: []cli.Flag{
				&cli.StringFlag{Name: "temp-dir", Value: d.TempDir, Usage: "runtime dir for logs and uploads"},
				&cli.StringFlag{Name: "home-dir", Hidden: true, Usage: "ignored; accepted for old shims"},
				&cli.StringFlag{Name: "http-address", Usage: "HTTP bind address (default: all interfaces)"},
				&cli.IntFlag{Name: "http-port", Value: d.HTTPPort, Usage: "HTTP API port"},
				&cli.IntFlag{Name: "ssh-port", Value: d.SSHPort, Usage: "SSH server port"},
				&cli.StringSliceFlag{Name: "ssh-authorized-key", Usage: "authorized public key (repeatable)"},
				&cli.StringFlag{Name: "ssh-log-level", Value: d.SSHLogLevel.String(), Usage: "SSH server log level"},
				&cli.StringSliceFlag{Name: "ssh-ciphers", Hidden: true, Usage: "SSH ciphers offered (default: AES-GCM)"},
				&cli.StringFlag{Name: "ssh-address", Usage: "SSH bind address (default: all interfaces)"},
				&cli.DurationFlag{Name: "ssh-login-grace", Value: d.SSH.LoginGrace, Usage: "time a connection has to authenticate"},
				&cli.IntFlag{Name: "ssh-max-startups", Value: d.SSH.MaxStartups, Usage: "unauthenticated connections held at once (the oldest is dropped past it)"},
				&cli.IntFlag{Name: "ssh-max-startups-per-source", Value: d.SSH.PerSource, Usage: "unauthenticated connections held from one address"},
				&cli.BoolFlag{Name: "ssh-gateway-ports", Usage: "let -R listen on non-loopback addresses"},
				&cli.BoolFlag{Name: "ssh-permit-user-environment", Usage: "apply environment= options of authorized keys"},
				&cli.DurationFlag{Name: "start-timeout", Value: d.StartTimeout, Hidden: true, Usage: "exit 1 when no job runs within this"},
				&cli.DurationFlag{Name: "logs-wait", Value: d.LogsWait, Hidden: true, Usage: "after the job, wait this long at most for logs to be read"},
				&cli.DurationFlag{Name: "linger", Value: d.Linger, Hidden: true, Usage: "stay up this long after the logs were pulled, for late readers"},
				&cli.DurationFlag{Name: "interrupt-grace", Value: d.Executor.InterruptGrace, Hidden: true, Usage: "on stop, time Ctrl-C is given before SIGTERM/SIGHUP"},
				&cli.Int64Flag{Name: "max-upload-bytes", Value: d.Executor.MaxUpload, EnvVars: []string{"TANDEM_RUNNER_MAX_UPLOAD_BYTES"}, Usage: "largest upload_code or upload_archive body (413 past it)"},
				&cli.Int64Flag{Name: "max-upload-total-bytes", Value: d.Executor.MaxUploadTotal, EnvVars: []string{"TANDEM_RUNNER_MAX_UPLOAD_TOTAL_BYTES"}, Usage: "all uploads of a job together"},
				&cli.Int64Flag{Name: "job-log-max-bytes", Value: d.Executor.LogRetention.Max, EnvVars: []string{"TANDEM_RUNNER_JOB_LOG_MAX_BYTES"}, Usage: "disk kept per job log file (raw output, stripped lines): the head and the latest output; -1 keeps all"},
				&cli.Int64Flag{Name: "job-log-head-bytes", Value: d.Executor.LogRetention.Head, EnvVars: []string{"TANDEM_RUNNER_JOB_LOG_HEAD_BYTES"}, Usage: "of --job-log-max-bytes, the start of the output always kept"},
				&cli.StringFlag{Name: "task-id", EnvVars: []string{"TANDEM_TASK_ID"}, Hidden: true, Usage: "the shim task this runner serves (said in its healthcheck)"},
				&cli.StringFlag{Name: "api-allow-uids", EnvVars: []string{"TANDEM_RUNNER_API_UIDS"}, Usage: "serve the HTTP API only to local clients whose socket is owned by one of these uids (comma-separated; the shim passes its root-equivalent accounts to host-network runners); empty: every client"},
				&cli.StringFlag{Name: "host-fs", EnvVars: []string{"TANDEM_RUNNER_HOST_FS"}, Usage: "a path on the host's filesystem (the shim binds an empty read-only dir) whose free space is watched beside --temp-dir's, when the runner dir is a filesystem of its own"},
				&cli.StringFlag{Name: "metrics-root", Value: d.Metrics.Root, EnvVars: []string{"TANDEM_RUNNER_METRICS_ROOT"}, Hidden: true, Usage: "read /dev and /sys for the job's GPU metrics under this dir (a fixture tree in tests)"},
				&cli.Int64Flag{Name: "log-min-free-bytes", EnvVars: []string{"TANDEM_RUNNER_LOG_MIN_FREE_BYTES"}, Usage: "free space under --temp-dir below which output is no longer kept (the job goes on); 0: a tenth of the filesystem, at most 256 MiB; -1: none"},
			},
			Action: func(c *cli.Context) error {
				level, err := logging.ParseLevel(c.String("log-level"))
				if err != nil {
					return err
				}
				format, err := logging.ParseFormat(c.String("log-format"))
				if err != nil {
					return err
				}
				sshLevel, err := logging.ParseLevel(c.String("ssh-log-level"))
				if err != nil {
					return fmt.Errorf("--ssh-log-level: %w", err)
				}
				ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM, syscall.SIGQUIT)
				defer stop()
				cfg := agent.Defaults()
				cfg.LogLevel, cfg.LogFormat, cfg.SSHLogLevel = level, format, sshLevel
				cfg.TempDir, cfg.HTTPAddress, cfg.HTTPPort = c.String("temp-dir"), c.String("http-address"), c.Int("http-port")
				cfg.SSHAddress, cfg.SSHPort, cfg.AuthorizedKeys = c.String("ssh-address"), c.Int("ssh-port"), c.StringSlice("ssh-authorized-key")
				cfg.StartTimeout, cfg.LogsWait, cfg.Linger = c.Duration("start-timeout"), c.Duration("logs-wait"), c.Duration("linger")
				cfg.SSH.Ciphers = splitCommas(c.StringSlice("ssh-ciphers"))
				cfg.SSH.LoginGrace, cfg.SSH.MaxStartups, cfg.SSH.PerSource = c.Duration("ssh-login-grace"), c.Int("ssh-max-startups"), c.Int("ssh-max-startups-per-source")
				cfg.SSH.GatewayPorts, cfg.SSH.PermitUserEnvironment = c.Bool("ssh-gateway-ports"), c.Bool("ssh-permit-user-environment")
				x := &cfg.Executor
				x.InterruptGrace, x.MaxUpload, x.MaxUploadTotal = c.Duration("interrupt-grace"), c.Int64("max-upload-bytes"), c.Int64("max-upload-total-bytes")
				x.LogRetention = logs.Retention{Head: c.Int64("job-log-head-bytes"), Max: c.Int64("job-log-max-bytes")}
				x.LogMinFree = c.Int64("log-min-free-bytes")
				x.HostFS = c.String("host-fs")
				cfg.Metrics.Root = c.String("metrics-root")
				_ = os.Unsetenv("TANDEM_RUNNER_METRICS_ROOT")
				_ = os.Unsetenv("TANDEM_RUNNER_HOST_FS")
				if cfg.APIUIDs, err = parseUIDs(c.String("api-allow-uids")); err != nil {
					return fmt.Errorf("--api-allow-uids: %w", err)
				}
				// The job inherits the runner's environment: the list is the
				// runner's, not the job's.
				_ = os.Unsetenv("TANDEM_RUNNER_API_UIDS")
				cfg.TaskID = c.String("task-id")
				_ = os.Unsetenv("TANDEM_TASK_ID")
				return run(ctx, cfg)
			},
		}},
	}
}

// parseUIDs reads "0,1000"; "" is nil (no check).
func parseUIDs(s string) ([]uint32, error) {
	var out []uint32
	for _, f := range splitCommas([]string{s}) {
		v, err := strconv.ParseUint(f, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("uid %q: %w", f, err)
		}
		out = append(out, uint32(v))
	}
	return out, nil
}

// splitCommas accepts a list flag both repeated and comma-separated.
func splitCommas(vals []string) []string {
	var out []string
	for _, v := range vals {
		for _, p := range strings.Split(v, ",") {
			if p = strings.TrimSpace(p); p != "" {
				out = append(out, p)
			}
		}
	}
	return out
}
