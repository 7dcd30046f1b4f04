// Package cli defines the tandem command line.
package cli

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v2"
	"golang.org/x/term"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/shimclient"
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

var shimFlag = &cli.StringFlag{Name: "shim", Value: "127.0.0.1:10998", EnvVars: []string{"TANDEM_SHIM"}, Usage: "shim address host:port (with --ssh: as seen on the host)"}

// connFlags reach a machine directly (--shim) or over SSH (--ssh), as the
// dstack server does.
func connFlags() []cli.Flag {
	return []cli.Flag{shimFlag,
		&cli.StringFlag{Name: "shim-token", EnvVars: []string{"TANDEM_SHIM_API_TOKEN"}, Usage: "bearer token for a shim started with --api-token"},
		&cli.StringFlag{Name: "ssh", EnvVars: []string{"TANDEM_SSH"}, Usage: "reach the host over SSH: user@host[:port]"},
		&cli.StringFlag{Name: "identity", Aliases: []string{"i"}, Usage: "SSH private key (default ~/.ssh/id_ed25519, id_rsa)"},
		&cli.StringFlag{Name: "known-hosts", Usage: "known_hosts file (default ~/.ssh/known_hosts)"},
	}
}

// dialer returns the SSH tunnel's dial function (nil without --ssh) and a
// closer for it.
func dialer(c *cli.Context) (func(context.Context, string, string) (net.Conn, error), func(), error) {
	if c.String("ssh") == "" {
		return nil, func() {}, nil
	}
	t, err := ctl.DialSSH(c.Context, ctl.SSHTarget{Target: c.String("ssh"), Identity: c.String("identity"), KnownHosts: c.String("known-hosts")})
	if err != nil {
		return nil, nil, exitError{1, err.Error()}
	}
	return t.Dial, func() { t.Close() }, nil
}

// App returns the tandem command.
func App() *cli.App {
	return &cli.App{
		Name:    "tandem",
		Usage:   "drive a run through dstack-shim and dstack-runner",
		Version: version.Tandem(),
		ExitErrHandler: func(c *cli.Context, err error) {
			var ee exitError
			if errors.As(err, &ee) {
				if ee.msg != "" {
					fmt.Fprintln(c.App.ErrWriter, "tandem:", ee.msg)
				}
				os.Exit(ee.code)
			}
			cli.HandleExitCoder(err)
		},
		Commands: []*cli.Command{runCmd(), psCmd(), logsCmd(), sshCmd(), stopCmd(), infoCmd(), cloudinitCmd(), entrypointCmd(), {
			Name:  "version",
			Usage: "print the version and the dstack protocol level",
			Action: func(c *cli.Context) error {
				_, err := fmt.Fprintf(c.App.Writer, "tandem %s (agents report dstack %s)\n", version.Tandem(), version.String())
				return err
			},
		}},
	}
}

func runCmd() *cli.Command {
	return &cli.Command{
		Name:      "run",
		Usage:     "run a command as a job on the shim's machine",
		ArgsUsage: "-- COMMAND [ARGS...]",
		Flags: append(connFlags(),
			&cli.IntFlag{Name: "runner-port", Value: 10999, Usage: "the runner HTTP port the shim uses (--runner-http-port)"},
			&cli.StringFlag{Name: "image", Value: "ubuntu:22.04", Usage: "container image"},
			&cli.StringFlag{Name: "name", Usage: "task name (default: tandem-<id>)"},
			&cli.StringFlag{Name: "gpus", Value: "0", Usage: "GPUs: a count, or all"},
			&cli.Float64Flag{Name: "cpu", Usage: "CPU limit in cores (0: none)"},
			&cli.StringFlag{Name: "memory", Usage: "memory limit, e.g. 8GiB"},
			&cli.StringFlag{Name: "shm-size", Usage: "/dev/shm size, e.g. 1GiB"},
			&cli.StringSliceFlag{Name: "env", Aliases: []string{"e"}, Usage: "KEY=VALUE (repeatable)"},
			&cli.StringFlag{Name: "workdir", Value: "/workflow", Usage: "working dir in the container"},
			&cli.StringFlag{Name: "code", Usage: "local directory uploaded into the working dir"},
			&cli.StringSliceFlag{Name: "mount", Usage: "HOSTPATH:PATH (repeatable)"},
			&cli.StringFlag{Name: "network", Value: "host", Usage: "host or bridge"},
			&cli.DurationFlag{Name: "max-duration", Usage: "stop the job after this long"},
			&cli.StringSliceFlag{Name: "authorized-key", Usage: "public key allowed into the container for tandem ssh (default: yours)"},
			outputFlag,
		),
		Action: func(c *cli.Context) error {
			cmd := c.Args().Slice()
			if len(cmd) == 0 {
				return exitError{2, "no command: tandem run [flags] -- COMMAND"}
			}
			o := ctl.RunOptions{Shim: c.String("shim"), ShimToken: c.String("shim-token"), RunnerPort: c.Int("runner-port"), Name: c.String("name"),
				Image: c.String("image"), CPU: c.Float64("cpu"), WorkDir: c.String("workdir"), CodeDir: c.String("code"),
				Network: c.String("network"), MaxDuration: c.Duration("max-duration"), Commands: cmd,
				Out: c.App.Writer, Status: c.App.ErrWriter, StatusTTY: isTerminal(os.Stderr), Env: map[string]string{}}
			jsonOut := c.String("output") == "json"
			if jsonOut {
				o.Status, o.StatusTTY = nil, false
			}
			var err error
			if o.GPUs, err = parseGPUs(c.String("gpus")); err != nil {
				return exitError{2, err.Error()}
			}
			if o.Memory, err = parseSize(c.String("memory")); err != nil {
				return exitError{2, "--memory: " + err.Error()}
			}
			if o.ShmSize, err = parseSize(c.String("shm-size")); err != nil {
				return exitError{2, "--shm-size: " + err.Error()}
			}
			for _, kv := range c.StringSlice("env") {
				k, v, ok := strings.Cut(kv, "=")
				if !ok || k == "" {
					return exitError{2, fmt.Sprintf("--env %q: want KEY=VALUE", kv)}
				}
				o.Env[k] = v
			}
			for _, m := range c.StringSlice("mount") {
				host, path, ok := strings.Cut(m, ":")
				if !ok || !filepath.IsAbs(host) || !filepath.IsAbs(path) {
					return exitError{2, fmt.Sprintf("--mount %q: want /host/path:/container/path", m)}
				}
				o.Mounts = append(o.Mounts, api.InstanceMountPoint{InstancePath: host, Path: path})
			}
			if o.CodeDir != "" {
				if fi, err := os.Stat(o.CodeDir); err != nil || !fi.IsDir() {
					return exitError{2, fmt.Sprintf("--code %s: not a directory", o.CodeDir)}
				}
			}
			if o.Network != "host" && o.Network != "bridge" {
				return exitError{2, "--network must be host or bridge"}
			}
			o.SSHKeys = c.StringSlice("authorized-key")
			if len(o.SSHKeys) == 0 {
				if k := ctl.DefaultPublicKey(c.String("identity")); k != "" {
					o.SSHKeys = []string{k}
				}
			}
			dial, closeDial, err := dialer(c)
			if err != nil {
				return err
			}
			defer closeDial()
			o.Dial = dial
			sigs := make(chan os.Signal, 2)
			signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
			defer signal.Stop(sigs)
			o.Interrupt = sigs
			res, err := ctl.Run(context.Background(), o)
			if jsonOut {
				out := map[string]any{"task_id": res.TaskID, "state": res.State, "exit_status": res.ExitStatus,
					"termination_reason": res.Reason, "termination_message": res.Message, "exit_code": res.ExitCode()}
				if err != nil {
					out["error"], out["exit_code"] = err.Error(), 1
				}
				if werr := writeJSON(c, out); werr != nil {
					return werr
				}
			}
			if err != nil {
				return exitError{1, err.Error()}
			}
			code := res.ExitCode()
			if code != 0 {
				return exitError{code, ctl.Describe(res)}
			}
			fmt.Fprintln(c.App.ErrWriter, ctl.Describe(res))
			return nil
		},
	}
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

// parseSize reads 512MiB, 8GiB, 1GB, 100M or plain bytes.
func parseSize(s string) (int64, error) {
	if s == "" {
		return 0, nil
	}
	units := []struct {
		suffix string
		mult   int64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}, {"TB", 1e12}, {"GB", 1e9}, {"MB", 1e6}, {"KB", 1e3},
		{"T", 1 << 40}, {"G", 1 << 30}, {"M", 1 << 20}, {"K", 1 << 10}, {"B", 1}}
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

// shim returns a client for the shim and a closer for its connection.
func shim(c *cli.Context) (*shimclient.Client, func(), error) {
	dial, closeDial, err := dialer(c)
	if err != nil {
		return nil, nil, err
	}
	s, err := shimclient.NewWithDialer(c.String("shim"), dial)
	if err == nil {
		s.SetToken(c.String("shim-token"))
	}
	if err != nil {
		closeDial()
		return nil, nil, exitError{2, err.Error()}
	}
	return s, closeDial, nil
}

var outputFlag = &cli.StringFlag{Name: "output", Aliases: []string{"o"}, Value: "text", Usage: "text or json"}

func writeJSON(c *cli.Context, v any) error {
	enc := json.NewEncoder(c.App.Writer)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func isTerminal(f *os.File) bool {
	return term.IsTerminal(int(f.Fd()))
}

func psCmd() *cli.Command {
	return &cli.Command{Name: "ps", Usage: "list the shim's tasks", Flags: append(connFlags(), outputFlag),
		Action: func(c *cli.Context) error {
			s, done, err := shim(c)
			if err != nil {
				return err
			}
			defer done()
			items, err := s.ListTasks(c.Context)
			if err != nil {
				return exitError{1, err.Error()}
			}
			infos := []api.TaskInfoResponse{}
			for _, it := range items {
				if info, err := s.GetTask(c.Context, it.ID); err == nil {
					infos = append(infos, info)
				}
			}
			if c.String("output") == "json" {
				return writeJSON(c, infos)
			}
			w := tabwriter.NewWriter(c.App.Writer, 2, 4, 2, ' ', 0)
			fmt.Fprintln(w, "TASK\tSTATUS\tCONTAINER\tREASON")
			for _, info := range infos {
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\n", info.ID, info.Status, info.ContainerName, info.TerminationReason)
			}
			return w.Flush()
		}}
}

func logsCmd() *cli.Command {
	return &cli.Command{Name: "logs", Usage: "stream a running task's output", ArgsUsage: "TASK", Flags: append(connFlags(),
		&cli.IntFlag{Name: "runner-port", Value: 10999, Usage: "the runner HTTP port the shim uses (host network)"},
		&cli.DurationFlag{Name: "since", Usage: "only output newer than this, e.g. 5m"}),
		Action: func(c *cli.Context) error {
			if c.NArg() != 1 {
				return exitError{2, "usage: tandem logs TASK"}
			}
			dial, closeDial, err := dialer(c)
			if err != nil {
				return err
			}
			defer closeDial()
			o := ctl.LogsOptions{Shim: c.String("shim"), ShimToken: c.String("shim-token"), RunnerPort: c.Int("runner-port"), Network: "host", Dial: dial}
			if d := c.Duration("since"); d > 0 {
				o.Since = time.Now().Add(-d)
			}
			if err := ctl.Logs(c.Context, c.Args().First(), o, c.App.Writer); err != nil {
				return exitError{1, err.Error()}
			}
			return nil
		}}
}

func sshCmd() *cli.Command {
	return &cli.Command{Name: "ssh", Usage: "open a shell (or run a command) in a task's container", ArgsUsage: "TASK [-- COMMAND...]",
		Flags: append(connFlags(),
			&cli.IntFlag{Name: "runner-ssh-port", Value: 10022, Usage: "the runner SSH port the shim uses (--runner-ssh-port)"},
			&cli.StringFlag{Name: "user", Aliases: []string{"u"}, Value: "root", Usage: "login in the container"}),
		Action: func(c *cli.Context) error {
			if c.NArg() < 1 {
				return exitError{2, "usage: tandem ssh TASK [-- COMMAND...]"}
			}
			dial, closeDial, err := dialer(c)
			if err != nil {
				return err
			}
			argv, err := ctl.SSHCommand(c.Context, c.Args().First(), ctl.SSHOptions{Shim: c.String("shim"), ShimToken: c.String("shim-token"),
				RunnerSSHPort: c.Int("runner-ssh-port"), Jump: c.String("ssh"), Identity: c.String("identity"),
				User: c.String("user"), Dial: dial}, c.Args().Slice()[1:])
			closeDial()
			if err != nil {
				return exitError{1, err.Error()}
			}
			bin, err := exec.LookPath("ssh")
			if err != nil {
				return exitError{1, "the OpenSSH client (ssh) is not installed"}
			}
			cmd := exec.Command(bin, argv[1:]...)
			cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, c.App.Writer, c.App.ErrWriter
			if err := cmd.Run(); err != nil {
				var ee *exec.ExitError
				if errors.As(err, &ee) {
					return exitError{ee.ExitCode(), ""}
				}
				return exitError{1, err.Error()}
			}
			return nil
		}}
}

func stopCmd() *cli.Command {
	return &cli.Command{Name: "stop", Usage: "terminate and remove a task", ArgsUsage: "TASK", Flags: append(connFlags(),
		&cli.UintFlag{Name: "timeout", Value: 10, Usage: "seconds of graceful stop"}),
		Action: func(c *cli.Context) error {
			if c.NArg() != 1 {
				return exitError{2, "usage: tandem stop TASK"}
			}
			s, done, err := shim(c)
			if err != nil {
				return err
			}
			defer done()
			id := c.Args().First()
			if _, err := s.TerminateTask(c.Context, id, api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser, Timeout: c.Uint("timeout")}); err != nil {
				return exitError{1, err.Error()}
			}
			if err := s.RemoveTask(c.Context, id); err != nil {
				return exitError{1, err.Error()}
			}
			fmt.Fprintln(c.App.Writer, "stopped", id)
			return nil
		}}
}

func infoCmd() *cli.Command {
	return &cli.Command{Name: "info", Usage: "shim version, GPUs, components", Flags: append(connFlags(), outputFlag),
		Action: func(c *cli.Context) error {
			s, done, err := shim(c)
			if err != nil {
				return err
			}
			defer done()
			hc, err := s.Healthcheck(c.Context)
			if err != nil {
				return exitError{1, fmt.Sprintf("shim at %s is not reachable: %v", c.String("shim"), err)}
			}
			if c.String("output") == "json" {
				out := map[string]any{"service": hc.Service, "version": hc.Version}
				if ii, err := s.InstanceInfo(c.Context); err == nil {
					out["instance"] = ii
				}
				if comps, err := s.Components(c.Context); err == nil {
					out["components"] = comps
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
			return nil
		}}
}
