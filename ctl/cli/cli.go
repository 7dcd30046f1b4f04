// Package cli defines the tandem command line.
package cli

import (
	"fmt"

	"github.com/urfave/cli/v2"

	"github.com/tandem-run/tandem/common/version"
)

// App returns the tandem command.
func App() *cli.App {
	return &cli.App{
		Name:    "tandem",
		Usage:   "drive a run through dstack-shim and dstack-runner",
		Version: version.String(),
		Commands: []*cli.Command{{
			Name:  "version",
			Usage: "print the version and the dstack protocol level",
			Action: func(c *cli.Context) error {
				_, err := fmt.Fprintf(c.App.Writer, "tandem %s (dstack protocol %s)\n", version.Tandem(), version.ProtocolLevel)
				return err
			},
		}},
	}
}
