// Command dstack-shim is the host agent: it runs each task as a Docker
// container with dstack-runner inside and serves the shim HTTP API.
package main

import (
	"fmt"
	"os"
	"runtime/debug"

	"github.com/tandem-run/tandem/shim/cli"
)

func main() {
	// An idle shim holds about 1 MiB of live heap, and Go's default pace
	// lets the heap reach 4 MiB and keeps it: a soft limit of 10 MiB (the
	// runtime's whole footprint, stacks and metadata included) took the
	// RSS after 120 API calls from 14.1 to 12.6 MB at 7 GC cycles; 8 MiB
	// saved 0.6 MB more but cost 147 cycles and three times the CPU. The
	// limit is soft: a shim with many tasks outgrows it and GC paces as
	// usual again, at most half the CPU. GOMEMLIMIT and GOGC in the
	// environment win.
	if os.Getenv("GOMEMLIMIT") == "" && os.Getenv("GOGC") == "" {
		debug.SetMemoryLimit(10 << 20)
	}
	if err := cli.App().Run(os.Args); err != nil {
		fmt.Fprintln(os.Stderr, "dstack-shim:", err)
		os.Exit(1)
	}
}
