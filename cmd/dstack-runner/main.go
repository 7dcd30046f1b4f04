// Command dstack-runner is the in-container agent: it runs one job and serves
// its logs and state. It is built static so it runs in any image.
package main

import (
	"fmt"
	"os"
	"runtime"
	"runtime/debug"

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
	if os.Getenv("GOMAXPROCS") == "" {
		runtime.GOMAXPROCS(procs(runtime.GOMAXPROCS(0)))
	}
	if err := cli.App().Run(os.Args); err != nil {
		fmt.Fprintln(os.Stderr, "dstack-runner:", err)
		os.Exit(1)
	}
}

// procs is the runner's GOMAXPROCS for the CPUs it may use (Go's default,
// which follows the container's CPU limit): one per four CPUs, 1 to 4.
// The runner's hot paths hand data from goroutine to goroutine (pty ->
// pipe, SSH packet -> mux -> channel -> socket); with a second P idle,
// every hand-off wakes a thread, which cost more than the work itself. On
// 2 vCPUs one P took SSH -L from 265 to 348 MiB/s with a third of the
// context switches per GiB, and the log pipeline from 0.73-0.77 to
// 0.84-0.86 of a raw pty reader (three alternating rounds). Bigger hosts
// keep a few Ps for concurrent connections. GOMAXPROCS in the environment
// wins.
func procs(cpus int) int { return min(max(cpus/4, 1), 4) }
