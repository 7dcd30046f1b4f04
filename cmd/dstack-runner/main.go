// Command dstack-runner is the in-container agent: it runs one job and serves
// its logs and state. It is built static so it runs in any image.
package main

import (
	"fmt"
	"os"

	"github.com/tandem-run/tandem/runner/cli"
)

func main() {
	if err := cli.App().Run(os.Args); err != nil {
		fmt.Fprintln(os.Stderr, "dstack-runner:", err)
		os.Exit(1)
	}
}
