package procs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// Prioritize gives every thread of this process the nice value nice (lower
// runs first) when the process is still at the default, 0: an operator's
// own choice (nice(1), systemd's Nice=) stands. It returns the nice value
// the process runs at after the call. A thread made later inherits the
// value from the thread that makes it, and one made while this runs is
// caught by another pass. Going below 0 needs CAP_SYS_NICE: without it
// the error says so and nothing changed.
//
// An agent's threads run little, but each answer waits for one to get a
// CPU, and where a burst of container starts keeps every CPU busy with
// the Docker engine's threads, a shim at the default nice waited for its
// turn: GET /api/tasks/{id}, as a client off the busy machine saw it, took
// 72-75 ms at the 99th percentile on 2 CPUs, and 48-50 ms at nice -10.
func Prioritize(nice int) (int, error) {
	const tasks = "/proc/self/task"
	own, err := threadNice(filepath.Join(tasks, strconv.Itoa(unix.Gettid())))
	if err != nil || own != 0 || nice == 0 {
		return own, err
	}
	for pass := 0; pass < 8; pass++ {
		entries, err := os.ReadDir(tasks)
		if err != nil {
			return own, fmt.Errorf("threads: %w", err)
		}
		changed := 0
		for _, e := range entries {
			tid, err := strconv.Atoi(e.Name())
			if err != nil {
				continue
			}
			cur, err := threadNice(filepath.Join(tasks, e.Name()))
			if err != nil || cur == nice {
				continue // gone, or done
			}
			if err := unix.Setpriority(unix.PRIO_PROCESS, tid, nice); err != nil {
				if errors.Is(err, unix.ESRCH) {
					continue
				}
				if changed == 0 && pass == 0 {
					// None changed yet (a lack of CAP_SYS_NICE shows here).
					return own, fmt.Errorf("nice %d for thread %d: %w", nice, tid, err)
				}
				return nice, fmt.Errorf("nice %d for thread %d: %w", nice, tid, err)
			}
			changed++
		}
		if changed == 0 {
			break
		}
	}
	return nice, nil
}

// threadNice reads a thread's nice value (stat field 19) from dir.
func threadNice(dir string) (int, error) {
	f, err := StatFields(dir)
	if err != nil {
		return 0, err
	}
	if len(f) < 17 {
		return 0, fmt.Errorf("%s/stat: %d fields", dir, len(f)+2)
	}
	return strconv.Atoi(f[16])
}
