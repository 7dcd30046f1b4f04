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
	// Room for 64 of the default size (128 GiB), whatever the disk has:
	// what this measures is the template's path; a disk with less room
	// gives later dirs less (BenchmarkMakeSized) or none.
	d := &Dirs{Size: DefaultSize, Statfs: roomy}
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

func roomy(string) (Space, error) { return Space{Free: 1 << 50, Total: 1 << 51}, nil }

// BenchmarkMakeSized makes one runner dir at a time: of the configured
// size (a sparse copy of the template; no ready copy is waiting, so each
// is copied in its start), and of a size of its own, where the disk had
// less room than that (a mkfs of its own).
func BenchmarkMakeSized(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("loop devices need root")
	}
	for _, c := range []struct {
		name string
		free int64
	}{{"template", 1 << 50}, {"own-mkfs", 1 << 30}} {
		b.Run(c.name, func(b *testing.B) {
			d := &Dirs{Size: DefaultSize, Statfs: func(string) (Space, error) { return Space{Free: c.free, Total: 1 << 51}, nil }}
			root := filepath.Join(b.TempDir(), "runners")
			if _, err := d.template(context.Background(), root, false); err != nil {
				b.Fatal(err)
			}
			d.Close() // no ready copy: each start makes its own image
			s0 := selfCPUTime()
			var children time.Duration
			for i := 0; i < b.N; i++ {
				p := filepath.Join(root, "task-"+strconv.Itoa(i))
				c0 := childCPUTime()
				if err := d.Make(context.Background(), p); err != nil {
					b.Fatal(err)
				}
				children += childCPUTime() - c0
				b.StopTimer()
				if err := d.Remove(p); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			b.ReportMetric(float64((selfCPUTime()-s0+children).Microseconds())/float64(b.N), "cpu-us/make")
		})
	}
}

func childCPUTime() time.Duration {
	var ru unix.Rusage
	_ = unix.Getrusage(unix.RUSAGE_CHILDREN, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkReserve64 is the room decision at a submit with 64 runner dirs'
// images on disk (a readdir, 64 stats, a statfs): the price of the rule on
// every submit and every Make.
func BenchmarkReserve64(b *testing.B) {
	runners := filepath.Join(b.TempDir(), "runners")
	if err := os.MkdirAll(runners, 0o755); err != nil {
		b.Fatal(err)
	}
	for i := range 64 {
		f, err := os.Create(filepath.Join(runners, "task-"+strconv.Itoa(i)+".ext4"))
		if err != nil {
			b.Fatal(err)
		}
		_ = f.Truncate(DefaultSize)
		_ = f.Close()
	}
	d := &Dirs{Size: DefaultSize, Statfs: roomy}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		release, err := d.Reserve(filepath.Join(runners, "new"))
		if err != nil {
			b.Fatal(err)
		}
		release()
	}
}
