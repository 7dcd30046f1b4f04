// Command dstack-runner is the in-container agent: it runs one job and serves
// its logs and state. It is built static so it runs in any image.
package main

import (
	"fmt"
	"os"
	"runtime/debug"

	_ "github.com/tandem-run/tandem/common/procs/early" // one P per four CPUs, 1 to 4, set during the inits
	"github.com/tandem-run/tandem/runner/cli"
)

func main() {
	// The runner shares the container with the job. A soft memory limit
	// keeps it small under log floods (18 MiB: the log bench peaks at 28.5
	// MiB RSS); below it, GC runs at a quarter of the default pace, which
	// SSH forwarding with many streams needs (8 -L streams: 181 -> 240-312
	// MiB/s here; GOGC=50 cost a quarter of it).
	if os.Getenv("GOMEMLIMIT") == "" && os.Getenv("GOGC") == "" {
		debug.SetMemoryLimit(18 << 20)
		debug.SetGCPercent(400)
	}
	if err := cli.App().Run(os.Args); err != nil {
		fmt.Fprintln(os.Stderr, "dstack-runner:", err)
		os.Exit(1)
	}
}
