package runnerdir

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// BenchmarkMake64 makes 64 bounded runner dirs at once, as a burst of
// task starts does, the template already made (the ready copy too, on the
// first burst only): the wall time per burst,
// this process's CPU (the system calls: copy, loop attach, mount), and the
// whole machine's CPU until 2 s after (kernel threads included: the loop
// workers, ext4's lazy inode table init).
func BenchmarkMake64(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("loop devices need root")
	}
	const n = 64
	d := &Dirs{Size: DefaultSize}
	b.Cleanup(d.Close)
	var wall, self, host time.Duration
	for i := 0; i < b.N; i++ {
		root := filepath.Join(b.TempDir(), "runners")
		if _, err := d.template(context.Background(), root, false); err != nil {
			b.Fatal(err)
		}
		paths := taskPaths(b, root, n)
		h0, s0, t0 := hostCPUTime(), selfCPUTime(), time.Now()
		var wg sync.WaitGroup
		for _, p := range paths {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := d.Make(context.Background(), p); err != nil {
					b.Error(err)
				}
			}()
		}
		wg.Wait()
		wall += time.Since(t0)
		self += selfCPUTime() - s0
		time.Sleep(2 * time.Second)
		host += hostCPUTime() - h0
		for _, p := range paths {
			if !d.mounted(p) {
				b.Errorf("%s is not mounted", p)
			}
			if err := d.Remove(p); err != nil {
				b.Error(err)
			}
		}
	}
	b.ReportMetric(float64(wall.Milliseconds())/float64(b.N), "wall-ms/burst")
	b.ReportMetric(float64(self.Milliseconds())/float64(b.N), "process-cpu-ms/burst")
	b.ReportMetric(float64(host.Milliseconds())/float64(b.N), "host-cpu-ms/burst+2s")
}

func selfCPUTime() time.Duration {
	var ru unix.Rusage
	_ = unix.Getrusage(unix.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func hostCPUTime() time.Duration {
	raw, _ := os.ReadFile("/proc/stat")
	line, _, _ := strings.Cut(string(raw), "\n")
	f := strings.Fields(line)
	var ticks int64
	for i, v := range f[1:] {
		if i == 3 || i == 4 { // idle, iowait
			continue
		}
		t, _ := strconv.ParseInt(v, 10, 64)
		ticks += t
	}
	return time.Duration(ticks) * 10 * time.Millisecond
}
