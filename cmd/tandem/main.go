// Command tandem is the thin control-plane client: it drives one run through
// dstack-shim and dstack-runner, from a laptop or over SSH.
package main

import (
	"fmt"
	"os"

	"github.com/tandem-run/tandem/ctl/cli"
)

func main() {
	if err := cli.Run(os.Args); err != nil {
		fmt.Fprintln(os.Stderr, "tandem:", err)
		os.Exit(1)
	}
}
