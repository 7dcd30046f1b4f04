package cli

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/cloudinit"
	"github.com/tandem-run/tandem/ctl"
)

func hostFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "ssh", Required: true, EnvVars: []string{"TANDEM_SSH"}, Usage: "the host: user@host[:port] (root, or passwordless sudo)"},
		&cli.StringFlag{Name: "identity", Aliases: []string{"i"}, Usage: "SSH private key (default ~/.ssh/id_ed25519, id_rsa)"},
		&cli.StringFlag{Name: "known-hosts", Usage: "known_hosts file (default ~/.ssh/known_hosts)"},
		&cli.StringFlag{Name: "prefix", Usage: "install every file under this directory (tests; hosts without a writable /usr); uses the supervisor script"},
		&cli.IntFlag{Name: "shim-http-port", Value: api.ShimHTTPPort, Usage: "the shim's API port"},
		&cli.IntFlag{Name: "runner-http-port", Value: api.RunnerHTTPPort, Usage: "the runner's HTTP port"},
		&cli.IntFlag{Name: "runner-ssh-port", Value: api.RunnerSSHPort, Usage: "the runner's SSH port"},
	}
}

func hostOptions(c *cli.Context) (ctl.HostOptions, error) {
	o := ctl.HostOptions{
		Target: ctl.SSHTarget{Target: c.String("ssh"), Identity: c.String("identity"), KnownHosts: c.String("known-hosts")},
		Layout: cloudinit.Layout{Prefix: c.String("prefix")},
		VM: cloudinit.VM{ShimHTTPPort: c.Int("shim-http-port"), RunnerHTTPPort: c.Int("runner-http-port"), RunnerSSHPort: c.Int("runner-ssh-port"),
			Privileged: c.Bool("privileged"), ShimHome: c.String("shim-home"), Env: map[string]string{}},
		ShimBinary: c.String("shim-binary"), RunnerBinary: c.String("runner-binary"), Dist: c.String("dist"),
		Progress: (&progressPrinter{w: c.App.ErrWriter}).event, Force: c.Bool("force"),
	}
	if err := parseEnv(wholeValues(c, "env"), o.VM.Env, nil); err != nil {
		return o, err
	}
	return o, o.Layout.Validate()
}

func hostCmd() *cli.Command {
	return &cli.Command{Name: "host", Usage: "install the agents on your own machine over SSH (no cloud needed)",
		Subcommands: []*cli.Command{{
			Name:  "install",
			Usage: "upload dstack-shim and dstack-runner, install the env file and systemd unit (a supervisor without systemd), start the shim",
			Description: "Idempotent: unchanged files stay, and the shim restarts only when something changed; running tasks\n" +
				"keep running across the restart. Refuses hosts without a working Docker.",
			Flags: append(hostFlags(),
				&cli.StringFlag{Name: "shim-binary", Usage: "local dstack-shim to upload (default: from --dist)"},
				&cli.StringFlag{Name: "runner-binary", Usage: "local dstack-runner to upload (default: from --dist)"},
				&cli.StringFlag{Name: "dist", Usage: "a `make release` directory (dist/<version>) with binaries per architecture"},
				&cli.StringFlag{Name: "shim-home", Usage: "DSTACK_SHIM_HOME (default /root/.dstack under the prefix)"},
				&cli.BoolFlag{Name: "privileged", Usage: "run every container privileged"},
				wholeFlags("extra KEY=VALUE for the shim (repeatable)", "env")[0],
			),
			Action: func(c *cli.Context) error {
				o, err := hostOptions(c)
				if err != nil {
					return exitError{ctl.ExitFailure, errText(err)}
				}
				ctx, cancel := context.WithTimeout(c.Context, 10*time.Minute)
				defer cancel()
				rep, err := ctl.InstallHost(ctx, o)
				if err != nil {
					return exitError{ctl.ExitFailure, errText(err)}
				}
				changed := "nothing changed"
				if len(rep.Changed) > 0 {
					changed = "updated " + strings.Join(rep.Changed, ", ")
				}
				restart := ""
				if rep.Restarted {
					restart = "; shim restarted (tasks kept)"
				}
				fmt.Fprintf(c.App.ErrWriter, "%s%s\n", changed, restart)
				fmt.Fprintf(c.App.Writer, "shim:      %s %s (tandem %s) on %s, %s, Docker %s\n", rep.Health.Service, rep.Health.Version, rep.Health.TandemVersion, rep.Arch, rep.Supervisor, rep.Docker)
				fmt.Fprintf(c.App.Writer, "use it:    tandem run --ssh %s --shim 127.0.0.1:%d -- nvidia-smi\n", o.Target.Target, c.Int("shim-http-port"))
				return nil
			},
		}, {
			Name:  "uninstall",
			Usage: "stop the shim and remove what install wrote (the shim's home stays)",
			Flags: append(hostFlags(), &cli.BoolFlag{Name: "force", Usage: "even when the shim still has tasks"}),
			Action: func(c *cli.Context) error {
				o, err := hostOptions(c)
				if err != nil {
					return exitError{ctl.ExitFailure, errText(err)}
				}
				if err := ctl.UninstallHost(c.Context, o); err != nil {
					return exitError{ctl.ExitFailure, errText(err)}
				}
				fmt.Fprintln(c.App.Writer, "uninstalled from", o.Target.Target)
				return nil
			},
		}}}
}
