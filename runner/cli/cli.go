// Package cli defines dstack-runner's command line, flag for flag with dstack's.
package cli

import (
	"errors"

	"github.com/urfave/cli/v2"

	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/common/version"
)

// Config is what `dstack-runner start` was asked to do.
type Config struct {
	LogLevel       string
	TempDir        string
	HTTPAddress    string
	HTTPPort       int
	SSHPort        int
	AuthorizedKeys []string
	SSHLogLevel    string
}

// ErrNotReady is returned by start until the runner's agent lands.
var ErrNotReady = errors.New("the job agent is not built yet")

// App returns the dstack-runner command. `--version` prints exactly
// "dstack-runner version <v>": the shim's component manager parses it.
func App() *cli.App {
	return &cli.App{
		Name:    "dstack-runner",
		Usage:   "run one dstack job inside its container",
		Version: version.String(),
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "log-level", Value: "info", Usage: "fatal, error, warn, info, debug, trace or 1..6"},
		},
		Before: func(c *cli.Context) error {
			_, err := logging.ParseLevel(c.String("log-level"))
			return err
		},
		Commands: []*cli.Command{{
			Name:  "start",
			Usage: "start the runner and wait for a job",
			Flags: []cli.Flag{
				&cli.StringFlag{Name: "temp-dir", Value: "/tmp/runner", Usage: "runtime dir for logs and uploads"},
				&cli.StringFlag{Name: "home-dir", Hidden: true, Usage: "ignored; accepted for old shims"},
				&cli.StringFlag{Name: "http-address", Usage: "HTTP bind address (default: all interfaces)"},
				&cli.IntFlag{Name: "http-port", Value: 10999, Usage: "HTTP API port"},
				&cli.IntFlag{Name: "ssh-port", Value: 10022, Usage: "SSH server port"},
				&cli.StringSliceFlag{Name: "ssh-authorized-key", Usage: "authorized public key (repeatable)"},
				&cli.StringFlag{Name: "ssh-log-level", Value: "INFO", Usage: "SSH server log level"},
			},
			Action: func(c *cli.Context) error {
				return ErrNotReady
			},
		}},
	}
}
