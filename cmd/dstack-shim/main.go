// Command dstack-shim is the host agent: it runs each task as a Docker
// container with dstack-runner inside and serves the shim HTTP API.
package main

import (
	"fmt"
	"os"

	"github.com/tandem-run/tandem/shim/cli"
)

func main() {
	if err := cli.App().Run(os.Args); err != nil {
		fmt.Fprintln(os.Stderr, "dstack-shim:", err)
		os.Exit(1)
	}
}
