// Package cli defines the tandem command line.
package cli

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"

	"github.com/urfave/cli/v2"
	"golang.org/x/term"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/version"
	"github.com/tandem-run/tandem/ctl"
)

// exitError carries the job's exit status to main.
type exitError struct {
	code int
	msg  string
}

func (e exitError) Error() string { return e.msg }
func (e exitError) ExitCode() int { return e.code }

// defaultShim is a shim on this machine at dstack's port.
var defaultShim = "127.0.0.1:" + strconv.Itoa(api.ShimHTTPPort)

var shimFlag = &cli.StringFlag{Name: "shim", Value: defaultShim, EnvVars: []string{"TANDEM_SHIM"}, Usage: "shim address host[:port] (port default 10998; with --ssh: as seen on the host)",
	Action: func(c *cli.Context, v string) error {
		addr, err := shimAddr(v)
		if err != nil {
			return err
		}
		return c.Set("shim", addr)
	}}

// shimAddr is a --shim value as host:port: a host alone gets dstack's
// port, as docker's -H gets its own; http:// is dropped. Anything else
// that is not host:port is refused with what to give.
func shimAddr(v string) (string, error) {
	bad := exitError{ctl.ExitFailure, fmt.Sprintf("--shim %q: want HOST[:PORT], e.g. 127.0.0.1:%d", v, api.ShimHTTPPort)}
	a := strings.TrimSuffix(strings.TrimPrefix(v, "http://"), "/")
	if strings.HasPrefix(a, "unix://") {
		return a, nil
	}
	if a == "" || strings.ContainsAny(a, "/ \t") {
		return "", bad
	}
	host, port, err := net.SplitHostPort(a)
	if err != nil {
		// A host alone (or an IPv6 address, bracketed or not).
		h := strings.Trim(a, "[]")
		if strings.Contains(h, "]") || strings.Contains(h, "[") {
			return "", bad
		}
		return net.JoinHostPort(h, strconv.Itoa(api.ShimHTTPPort)), nil
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 || host == "" {
		return "", bad
	}
	return a, nil
}

// connFlags reach a machine directly (--shim) or over SSH (--ssh), as the
// dstack server does.
func connFlags() []cli.Flag {
	return connFlagsAs([]string{"i"})
}

// connFlagsAs is connFlags with --identity's aliases given: none where -i
// is docker's (run, exec).
func connFlagsAs(identityAliases []string) []cli.Flag {
	return []cli.Flag{shimFlag,
		&cli.StringFlag{Name: "shim-token", EnvVars: []string{"TANDEM_SHIM_API_TOKEN"}, Usage: "bearer token for a shim started with --api-token"},
		&cli.StringFlag{Name: "ssh", EnvVars: []string{"TANDEM_SSH"}, Usage: "reach the host over SSH: user@host[:port]"},
		&cli.StringFlag{Name: "identity", Aliases: identityAliases, Usage: "SSH private key (default ~/.ssh/id_ed25519, id_rsa)"},
		&cli.StringFlag{Name: "known-hosts", Usage: "known_hosts file (default ~/.ssh/known_hosts)"},
	}
}

// client is the command's one ctl client, as connFlags say (--shim over
// --ssh when given), with progress its Progress; done closes its SSH
// tunnel.
func client(c *cli.Context, progress func(ctl.Event)) (cl *ctl.Client, done func(), err error) {
	cfg, done, err := config(c, c.String("shim"), c.String("ssh"))
	if err != nil {
		return nil, nil, err
	}
	cfg.Progress = progress
	if cl, err = newClient(cfg); err != nil {
		done()
		return nil, nil, err
	}
	return cl, done, nil
}

// config is the command's ctl.Config for the shim at shim, reached over
// the SSH host ssh when not "" (its tunnel dialed here: done closes it),
// with the runner ports and the key its flags give.
func config(c *cli.Context, shim, ssh string) (cfg ctl.Config, done func(), err error) {
	dial, done, err := dialTo(c, ssh)
	if err != nil {
		return ctl.Config{}, nil, err
	}
	return ctl.Config{Shim: shim, ShimToken: c.String("shim-token"), Dial: dial,
		Ports: ctl.Ports{HTTP: c.Int("runner-port"), SSH: c.Int("runner-ssh-port")},
		SSH:   ctl.SSHTarget{Target: ssh, Identity: c.String("identity"), KnownHosts: c.String("known-hosts")}}, done, nil
}

// newClient is ctl.NewClient, its refusal worded for the command line.
func newClient(cfg ctl.Config) (*ctl.Client, error) {
	cl, err := ctl.NewClient(cfg)
	if err != nil {
		return nil, exitError{ctl.ExitFailure, errText(err)}
	}
	return cl, nil
}

// interruptible is client with a context that the first Ctrl-C (or
// SIGTERM) cancels; done closes the connection and stops listening.
func interruptible(c *cli.Context, progress func(ctl.Event)) (ctx context.Context, cl *ctl.Client, done func(), err error) {
	cl, closeClient, err := client(c, progress)
	if err != nil {
		return nil, nil, nil, err
	}
	ctx, cancel := context.WithCancel(c.Context)
	stop := onSignals(cancel, func() {})
	return ctx, cl, func() { stop(); cancel(); closeClient() }, nil
}

// dialTo dials the SSH target given and returns its tunnel's dial
// function and a closer for it ("": direct, a nil dial).
func dialTo(c *cli.Context, target string) (func(context.Context, string, string) (net.Conn, error), func(), error) {
	if target == "" {
		return nil, func() {}, nil
	}
	t, err := ctl.DialSSH(c.Context, ctl.SSHTarget{Target: target, Identity: c.String("identity"), KnownHosts: c.String("known-hosts")})
	if err != nil {
		return nil, nil, exitError{ctl.ExitFailure, errText(err)}
	}
	return t.Dial, func() { t.Close() }, nil
}

// Run runs the tandem command with argv (os.Args): the command line as
// typed is kept, so that `run IMAGE CMD` can tell an image from a command
// after `--`.
func Run(argv []string) error {
	app := App()
	w := app.ErrWriter
	if w == nil {
		w = os.Stderr
	}
	argv, err := dockerArgs(app, argv, w)
	if err == nil {
		app.Metadata = map[string]any{argvKey: argv}
		err = app.Run(argv)
	}
	// A flag's own check (-o) fails before the command's error handler
	// runs: its exit code is applied here.
	var ee exitError
	if errors.As(err, &ee) {
		if ee.msg != "" {
			fmt.Fprintln(w, "tandem:", api.PrintableLines(ee.msg))
		}
		os.Exit(ee.code)
	}
	return err
}

const argvKey = "argv"

// App returns the tandem command.
func App() *cli.App {
	app := &cli.App{
		Name:                 "tandem",
		Usage:                "drive a run through dstack-shim and dstack-runner",
		Version:              version.Tandem(),
		EnableBashCompletion: true,
		ExitErrHandler: func(c *cli.Context, err error) {
			var ee exitError
			if errors.As(err, &ee) {
				if ee.msg != "" {
					fmt.Fprintln(c.App.ErrWriter, "tandem:", api.PrintableLines(ee.msg))
				}
				os.Exit(ee.code)
			}
			if err != nil {
				fmt.Fprintln(c.App.ErrWriter, "tandem:", errText(err))
				os.Exit(ctl.ExitFailure)
			}
		},
		// Bad usage is tandem's own failure: 125, as docker run, so that it
		// never reads as the job's status.
		OnUsageError: usageError,
		CommandNotFound: func(c *cli.Context, name string) {
			fmt.Fprintf(c.App.ErrWriter, "tandem: unknown command %q (tandem help lists them)\n", name)
			os.Exit(ctl.ExitFailure)
		},
		Commands: []*cli.Command{runCmd(), attachCmd(), psCmd(), portCmd(), logsCmd(), statsCmd(), waitCmd(), sshCmd(), execCmd(), cpCmd(), stopCmd(), rmCmd(), pruneCmd(),
			sshConfigCmd(), infoCmd(), hostCmd(), cloudinitCmd(), entrypointCmd(), completionCmd(), {
				Name:  "version",
				Usage: "print the version and the dstack protocol level",
				Action: func(c *cli.Context) error {
					_, err := fmt.Fprintf(c.App.Writer, "tandem %s (agents report dstack %s)\n", version.Tandem(), version.String())
					return err
				},
			}},
	}
	var setUsage func([]*cli.Command)
	setUsage = func(cmds []*cli.Command) {
		for _, cmd := range cmds {
			cmd.OnUsageError = usageError
			setUsage(cmd.Subcommands)
		}
	}
	setUsage(app.Commands)
	return app
}

func usageError(c *cli.Context, err error, _ bool) error {
	return exitError{ctl.ExitFailure, err.Error() + " (see tandem " + c.Command.Name + " --help)"}
}

// parseEnv adds --env KEY=VALUE pairs to into (a later pair wins). With
// lookup (a job's -e, as docker run takes it), a bare KEY passes this
// machine's value, or nothing when it has none; without, it is refused.
func parseEnv(kvs []string, into map[string]string, lookup func(string) (string, bool)) error {
	for _, kv := range kvs {
		k, v, ok := strings.Cut(kv, "=")
		switch {
		case k == "" || !ok && lookup == nil:
			return fmt.Errorf("--env %q: want KEY=VALUE", kv)
		case ok:
			into[k] = v
		default:
			if v, set := lookup(k); set {
				into[k] = v
			} else {
				delete(into, k) // unset here: unset there, as docker does
			}
		}
	}
	return nil
}

func parseGPUs(s string) (int, error) {
	if s == "all" {
		return -1, nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("--gpus %q: want a count or all", s)
	}
	return n, nil
}

// parseSize reads 512MiB, 8GiB, 1GB, 100M or plain bytes, and docker's
// lowercase 512m, 8g (binary, as docker reads them).
func parseSize(s string) (int64, error) {
	if s == "" {
		return 0, nil
	}
	units := []struct {
		suffix string
		mult   int64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}, {"TB", 1e12}, {"GB", 1e9}, {"MB", 1e6}, {"KB", 1e3},
		{"T", 1 << 40}, {"G", 1 << 30}, {"M", 1 << 20}, {"K", 1 << 10}, {"B", 1},
		{"t", 1 << 40}, {"g", 1 << 30}, {"m", 1 << 20}, {"k", 1 << 10}, {"b", 1}}
	for _, u := range units {
		if num, ok := strings.CutSuffix(s, u.suffix); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(num), 64)
			if err != nil || f < 0 {
				return 0, fmt.Errorf("%q is not a size", s)
			}
			return int64(f * float64(u.mult)), nil
		}
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("%q is not a size", s)
	}
	return n, nil
}

var outputFlag = &cli.StringFlag{Name: "output", Aliases: []string{"o"}, Value: "text", Usage: "text or json",
	Action: func(_ *cli.Context, v string) error {
		if v != "text" && v != "json" {
			return exitError{ctl.ExitFailure, fmt.Sprintf("-o %q: want text or json", v)}
		}
		return nil
	}}

func writeJSON(c *cli.Context, v any) error {
	enc := json.NewEncoder(c.App.Writer)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// isTerminal says whether w is a terminal (an *os.File on one).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

func infoCmd() *cli.Command {
	return &cli.Command{Name: "info", Usage: "shim version, GPUs, components", Flags: append(connFlags(), outputFlag),
		Action: func(c *cli.Context) error {
			cl, done, err := client(c, nil)
			if err != nil {
				return err
			}
			defer done()
			s := cl.Shim()
			hc, err := s.Healthcheck(c.Context)
			if err != nil {
				return exitError{ctl.ExitFailure, errText(ctl.ShimUnreached(c.String("shim"), err))}
			}
			if c.String("output") == "json" {
				out := map[string]any{"service": hc.Service, "version": hc.Version}
				if ii, err := s.InstanceInfo(c.Context); err == nil {
					out["instance"] = ii
				}
				if comps, err := s.Components(c.Context); err == nil {
					out["components"] = comps
				}
				if h, err := s.InstanceHealth(c.Context); err == nil {
					out["health"] = h
				}
				return writeJSON(c, out)
			}
			fmt.Fprintf(c.App.Writer, "shim:      %s %s (tandem %s)\n", hc.Service, hc.Version, cmp.Or(hc.TandemVersion, "unknown: not a Tandem shim"))
			if ii, err := s.InstanceInfo(c.Context); err == nil {
				vendor := string(ii.GPUVendor)
				if vendor == "" {
					vendor = "none"
				}
				line := "gpus:      vendor " + vendor
				if ii.GPUDriverVersion != "" {
					line += ", driver " + ii.GPUDriverVersion
				}
				fmt.Fprintln(c.App.Writer, line)
			}
			if comps, err := s.Components(c.Context); err == nil {
				for _, cp := range comps {
					fmt.Fprintf(c.App.Writer, "component: %s %s (%s)\n", cp.Name, cp.Version, cp.Status)
				}
			}
			if h, err := s.InstanceHealth(c.Context); err == nil {
				fmt.Fprintln(c.App.Writer, "health:    "+healthLine(h.DCGM))
			}
			return nil
		}}
}

// healthLine is the instance health as the dstack server grades it, with
// the first incident's message, the one the server shows.
func healthLine(h *api.DCGMHealth) string {
	if h == nil {
		return "ok"
	}
	grade := map[int]string{api.HealthPass: "ok", api.HealthWarn: "warning", api.HealthFail: "failure"}[h.OverallHealth]
	if grade == "" {
		grade = fmt.Sprintf("unknown (%d)", h.OverallHealth)
	}
	if len(h.Incidents) == 0 {
		return grade
	}
	line := grade + ": " + h.Incidents[0].ErrorMessage
	if n := len(h.Incidents) - 1; n > 0 {
		line += fmt.Sprintf(" (and %d more)", n)
	}
	return line
}
