// Command dstack-runner is the in-container agent: it runs one job and serves
// its logs and state. It is built static so it runs in any image.
package main

import (
	"fmt"
	"os"
	"runtime/debug"

	"github.com/tandem-run/tandem/runner/cli"
)

func main() {
	// The runner shares the container with the job: keep its heap tight
	// (log volume flows through it) unless GOGC says otherwise.
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(50)
	}
	if err := cli.App().Run(os.Args); err != nil {
		fmt.Fprintln(os.Stderr, "dstack-runner:", err)
		os.Exit(1)
	}
}
