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
	// The runner shares the container with the job. A soft memory limit
	// keeps it small under log floods while normal GC pacing keeps SSH
	// forwarding fast (GOGC=50 cost a quarter of forward throughput).
	if os.Getenv("GOMEMLIMIT") == "" && os.Getenv("GOGC") == "" {
		debug.SetMemoryLimit(20 << 20)
	}
	if err := cli.App().Run(os.Args); err != nil {
		fmt.Fprintln(os.Stderr, "dstack-runner:", err)
		os.Exit(1)
	}
}
