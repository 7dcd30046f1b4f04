// Command dstack-shim is the host agent: it runs each task as a Docker
// container with dstack-runner inside and serves the shim HTTP API.
package main

import (
	"fmt"
	"os"

	"github.com/tandem-run/tandem/common/gctune"
	_ "github.com/tandem-run/tandem/common/procs/early" // one P per four CPUs, 1 to 4, set during the inits
	"github.com/tandem-run/tandem/shim/cli"
)

func main() {
	// An idle shim holds about 1 MiB of live heap, and Go's default pace
	// lets the heap reach 4 MiB and keeps it: a soft limit of 10 MiB (the
	// runtime's whole footprint, stacks and metadata included) took the
	// RSS after 120 API calls from 14.1 to 12.6 MB. A fixed limit made the
	// collector thrash under load, though (a 64-task burst: GET p99 324
	// ms, 45 without it), so the limit follows the live heap after each
	// collection and 10 MiB is only its floor (common/gctune). GOMEMLIMIT
	// and GOGC in the environment win.
	if os.Getenv("GOMEMLIMIT") == "" && os.Getenv("GOGC") == "" {
		gctune.Start(10 << 20)
	}
	if err := cli.App().Run(os.Args); err != nil {
		fmt.Fprintln(os.Stderr, "dstack-shim:", err)
		os.Exit(1)
	}
}
