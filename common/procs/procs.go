// Package procs sets how many threads run an agent's Go code at once
// (GOMAXPROCS).
//
// Both agents are small I/O-bound programs whose hot paths hand work from
// goroutine to goroutine: the runner's pty -> pipe and SSH packet -> mux ->
// channel -> socket, the shim's accepted request -> handler -> response.
// With a second P idle, every hand-off wakes a thread, and on a VM whose
// context switches are expensive that cost more than the work itself. On 2
// vCPUs one P took the runner's SSH -L from 265 to 348 MiB/s with a third
// of the context switches per GiB, the log pipeline from 0.73-0.77 to
// 0.84-0.86 of a raw pty reader, and the shim's CPU per GET /api/tasks/{id}
// from 110 to 70-90 µs (Go's default: one P per CPU). Bigger hosts keep a
// few Ps for concurrent connections and Docker calls.
package procs

import "runtime"

// For is the GOMAXPROCS for cpus usable CPUs (Go's default, which follows
// a container's CPU limit): one per four CPUs, 1 to 4.
func For(cpus int) int { return min(max(cpus/4, 1), 4) }

// Set applies For to the CPUs Go found, unless GOMAXPROCS is in the
// environment (getenv), which wins. It returns the value in force.
func Set(getenv func(string) string) int {
	if getenv("GOMAXPROCS") != "" {
		return runtime.GOMAXPROCS(0)
	}
	n := For(runtime.GOMAXPROCS(0))
	runtime.GOMAXPROCS(n)
	return n
}
