package e2e

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api/runnerclient"
	"github.com/tandem-run/tandem/e2e/testenv"
	"golang.org/x/sys/unix"
)

// benchRunner starts the runner as PID 1 of a busybox container (no init, so
// the container's PID is the runner's) and returns its client, host pid,
// container name, and end: removing the container and its temp dir and
// flushing what it wrote, so a next run starts from the same state (runs
// left 400 MB of job logs each, and the writeback of earlier runs' logs
// took CPU from later ones: run-order ratios fell from 1.1 to 0.5).
func benchRunner(b *testing.B) (*runnerclient.Client, int, string, func()) {
	b.Helper()
	bins := testenv.Binaries(b)
	img := testenv.Busybox(b)
	_, port, _ := net.SplitHostPort(testenv.FreeAddr(b))
	_, sshPort, _ := net.SplitHostPort(testenv.FreeAddr(b))
	name := randomID("bench-runner")
	ctx := context.Background()
	tmp, err := os.MkdirTemp("", "bench-runner-")
	if err != nil {
		b.Fatal(err)
	}
	end := func() {
		_, _ = testenv.Docker(context.Background(), "rm", "-f", name)
		_ = os.RemoveAll(tmp)
		unix.Sync()
	}
	b.Cleanup(end)
	if _, err := testenv.Docker(ctx, "run", "-d", "--name", name, "--network", "host", "-e", "GOMAXPROCS="+os.Getenv("TANDEM_BENCH_RUNNER_GOMAXPROCS"),
		"-v", bins.Runner+":/usr/local/bin/dstack-runner:ro", "-v", tmp+":/tmp/runner",
		"--entrypoint", "/usr/local/bin/dstack-runner", img,
		"start", "--temp-dir", "/tmp/runner", "--http-port", port, "--http-address", "127.0.0.1", "--ssh-port", sshPort); err != nil {
		b.Fatal(err)
	}
	pidStr, err := testenv.Docker(ctx, "inspect", "--format", "{{.State.Pid}}", name)
	if err != nil {
		b.Fatal(err)
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(pidStr))
	c, _ := runnerclient.New("127.0.0.1:" + port)
	for i := 0; ; i++ {
		if _, err := c.Healthcheck(ctx); err == nil {
			return c, pid, name, end
		}
		if i > 300 {
			b.Fatal("runner did not start")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func mbEnv(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// writeCmd prints mb MiB of 100-byte lines.
func writeCmd(mb int) string {
	return fmt.Sprintf(`yes "$(printf '%%099d' 0)" | head -c %d`, mb<<20)
}

// pullAll consumes the job's logs like the server and returns the bytes
// delivered and when the final state was first seen. It pulls every
// interval (the dstack server polls a runner every few seconds; 0: as fast
// as answers come) until eager is closed, then as fast as it can.
func pullAll(b *testing.B, c *runnerclient.Client, start time.Time, interval time.Duration, eager <-chan struct{}) (got int64, jobEnd time.Duration) {
	ctx := context.Background()
	var ts int64
	final := false
	for {
		p, err := c.Pull(ctx, ts)
		if err != nil {
			b.Fatal(err)
		}
		for _, l := range p.JobLogs {
			got += int64(len(l.Message))
		}
		ts = p.LastUpdated
		if n := len(p.JobStates); n > 0 && p.JobStates[n-1].State.Final() && !final {
			final, jobEnd = true, time.Since(start)
		}
		if final && !p.HasMore {
			return got, jobEnd
		}
		select {
		case <-eager:
			interval = 0
		default:
		}
		switch {
		case interval > 0:
			time.Sleep(interval)
		case len(p.JobLogs) == 0:
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// childExit reports when pid's child process named comm is gone. It polls
// for the child every 5 ms until it appears, then waits on a pidfd: a
// /proc poll during the job took a tenth of this 2-core machine's CPU from
// the pipeline it measures.
func childExit(pid int, comm string) <-chan time.Time {
	out := make(chan time.Time, 1)
	go func() {
		deadline := time.Now().Add(5 * time.Minute)
		for time.Now().Before(deadline) {
			tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
			for _, t := range tasks {
				b, _ := os.ReadFile(t)
				for _, child := range strings.Fields(string(b)) {
					if c, _ := os.ReadFile("/proc/" + child + "/comm"); strings.TrimSpace(string(c)) != comm {
						continue
					}
					cpid, _ := strconv.Atoi(child)
					fd, err := unix.PidfdOpen(cpid, 0)
					if err != nil { // gone already
						out <- time.Now()
						return
					}
					fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
					for {
						if _, err := unix.Poll(fds, -1); err != unix.EINTR {
							break
						}
					}
					out <- time.Now()
					unix.Close(fd)
					return
				}
			}
			time.Sleep(5 * time.Millisecond)
		}
		out <- time.Now()
	}()
	return out
}

// readRSS returns a process's resident set in KiB, 0 when it is gone.
func readRSS(pid int) int {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(l, "VmRSS:") {
			n, _ := strconv.Atoi(strings.Fields(l)[1])
			return n
		}
	}
	return 0
}

// rawReaderSrc is a plain pty reader: cat prints a file into a fresh pty
// and the program reads it into nothing with the runner's 32 KiB buffer,
// then prints MiB/s. Standard library only, so it builds static and runs
// in the runner's own container (same seccomp filter and cgroup).
const rawReaderSrc = `package main

import (
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"time"
	"unsafe"
)

func ioctl(fd uintptr, req uintptr, arg unsafe.Pointer) {
	if _, _, e := syscall.Syscall(syscall.SYS_IOCTL, fd, req, uintptr(arg)); e != 0 {
		panic(e)
	}
}

func main() {
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR, 0)
	if err != nil {
		panic(err)
	}
	var n, unlock uint32
	ioctl(m.Fd(), syscall.TIOCGPTN, unsafe.Pointer(&n))
	ioctl(m.Fd(), syscall.TIOCSPTLCK, unsafe.Pointer(&unlock))
	s, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		panic(err)
	}
	cmd := exec.Command("cat", os.Args[1])
	cmd.Stdin, cmd.Stdout, cmd.Stderr = s, s, s
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true}
	start := time.Now()
	if err := cmd.Start(); err != nil {
		panic(err)
	}
	s.Close()
	buf := make([]byte, 32<<10)
	var total int64
	for {
		k, err := m.Read(buf)
		total += int64(k)
		if err != nil {
			break
		}
	}
	_ = cmd.Wait()
	fmt.Printf("%d %f\n", total, float64(total)/(1<<20)/time.Since(start).Seconds())
}
`

// rawReader builds the raw pty reader once (static) and returns its path.
func rawReader(b *testing.B) string {
	b.Helper()
	dir := b.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(rawReaderSrc), 0o644); err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module rawpty\n\ngo 1.22\n"), 0o644); err != nil {
		b.Fatal(err)
	}
	cmd := exec.Command("go", "build", "-o", "rawpty", ".")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		b.Fatalf("build the raw reader: %v %s", err, out)
	}
	return filepath.Join(dir, "rawpty")
}

// rawPtyRead runs the raw reader in container name over its /tmp/big (the
// job's file): the machine's bound for the log pipeline. Returns MiB/s.
func rawPtyRead(b *testing.B, name, reader string, mb int) float64 {
	b.Helper()
	ctx := context.Background()
	if _, err := testenv.Docker(ctx, "cp", reader, name+":/tmp/rawpty"); err != nil {
		b.Fatal(err)
	}
	out, err := testenv.Docker(ctx, "exec", name, "/tmp/rawpty", "/tmp/big")
	if err != nil {
		b.Fatal(err)
	}
	var n int64
	var mibs float64
	if _, err := fmt.Sscan(out, &n, &mibs); err != nil || n < int64(mb)<<20 {
		b.Fatalf("raw reader: %q %v", out, err)
	}
	return mibs
}

// BenchmarkRunnerLogThroughput: a job writes TANDEM_BENCH_LOG_MB (100) MiB
// through the pty, more than the runner's 32 MiB log bound, while a reader
// pulls /api/pull as fast as it answers; every byte must arrive (the job is
// held while the reader is behind, never its output dropped). Reports the
// job's own run time against a raw pty reader of the same file on the same
// machine (target ≥ 0.67x), the time until the puller had every byte, and
// the runner's peak RSS (target < 30 MiB).
func BenchmarkRunnerLogThroughput(b *testing.B) {
	mb := mbEnv("TANDEM_BENCH_LOG_MB", 100)
	// Each run measures the raw reader right before the runner, and the
	// medians are reported: this VM's speed drifts between runs.
	var pipeline, raws, ratios, delivered, peaks, cpus []float64
	reader := rawReader(b)
	for i := 0; i < b.N; i++ {
		c, pid, name, end := benchRunner(b)
		ctx := context.Background()
		// The output is prepared first so the job's pace is the terminal's,
		// not busybox yes's (one 100-byte write per line).
		if _, err := testenv.Docker(ctx, "exec", name, "sh", "-c", writeCmd(mb)+" > /tmp/big"); err != nil {
			b.Fatal(err)
		}
		unix.Sync() // its writeback is not part of either measurement
		raw := rawPtyRead(b, name, reader, mb)
		var mu sync.Mutex
		var samples []int
		stop := make(chan struct{})
		go func() {
			t := time.NewTicker(50 * time.Millisecond)
			defer t.Stop()
			for {
				select {
				case <-stop:
					return
				case <-t.C:
					if kib := readRSS(pid); kib > 0 {
						mu.Lock()
						samples = append(samples, kib)
						mu.Unlock()
					}
				}
			}
		}()
		cpu0 := processCPU(pid)
		if err := c.Submit(ctx, job("/bin/cat", "/tmp/big")); err != nil {
			b.Fatal(err)
		}
		start := time.Now()
		catDone := childExit(pid, "cat")
		var jobEnd time.Duration
		ended := make(chan struct{})
		go func() { jobEnd = (<-catDone).Sub(start); close(ended) }()
		if _, _, err := c.Run(ctx); err != nil {
			b.Fatal(err)
		}
		got, _ := pullAll(b, c, start, 0, ended)
		<-ended
		deliveredIn := time.Since(start)
		cpu := processCPU(pid) - cpu0
		close(stop)
		if want := int64(mb << 20); got < want {
			b.Fatalf("delivered %d bytes, want %d", got, want)
		}
		mu.Lock()
		peak := 0
		for _, v := range samples {
			peak = max(peak, v)
		}
		mu.Unlock()
		end()
		pipeline = append(pipeline, float64(mb)/jobEnd.Seconds())
		raws = append(raws, raw)
		ratios = append(ratios, float64(mb)/jobEnd.Seconds()/raw)
		delivered = append(delivered, float64(mb)/deliveredIn.Seconds())
		peaks = append(peaks, float64(peak)/1024)
		cpus = append(cpus, float64(cpu.Microseconds())/float64(mb))
	}
	// The pipeline's pace is the job's: cat ends when the runner has read
	// (and stored) its last byte.
	b.Logf("ratios vs the raw reader, in run order: %.2f", ratios)
	b.ReportMetric(medianOf(pipeline), "pipeline-MiB/s")
	b.ReportMetric(medianOf(raws), "raw-pty-MiB/s")
	b.ReportMetric(medianOf(ratios), "ratio-vs-raw-pty")
	b.ReportMetric(medianOf(delivered), "delivered-MiB/s")
	b.ReportMetric(slices.Max(peaks), "peak-rss-MiB")
	// The runner's own CPU time per MiB carried (reading, storing,
	// stripping, serving the pulls): unlike the pace, a busy machine
	// hardly moves it.
	b.ReportMetric(medianOf(cpus), "runner-cpu-us-per-MiB")
	target(b, "ratio vs the raw pty reader", medianOf(ratios), ">=", 0.67)
	target(b, "runner peak RSS MiB", slices.Max(peaks), "<", 30)
}

// target logs a figure against its target, and says when it misses.
func target(b *testing.B, what string, got float64, op string, want float64) {
	b.Helper()
	ok := op == ">=" && got >= want || op == "<" && got < want || op == "<=" && got <= want
	verdict := "ok"
	if !ok {
		verdict = "MISSED"
	}
	b.Logf("target %s: %.2f (want %s %.2f): %s", what, got, op, want, verdict)
}

func medianOf(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

// BenchmarkRunnerPullWithBigHistory: after a job wrote
// TANDEM_BENCH_HISTORY_MB (1024) MiB, each op pulls one page at a timestamp
// spread over the whole history; reports the slowest page.
func BenchmarkRunnerPullWithBigHistory(b *testing.B) {
	mb := mbEnv("TANDEM_BENCH_HISTORY_MB", 1024)
	c, pid, _, _ := benchRunner(b)
	ctx := context.Background()
	if err := c.Submit(ctx, job("/bin/sh", "-c", writeCmd(mb))); err != nil {
		b.Fatal(err)
	}
	if _, _, err := c.Run(ctx); err != nil {
		b.Fatal(err)
	}
	// Wait for the end without consuming: a pull past every timestamp
	// carries nothing, and has_more turns false when the job is over.
	for {
		p, err := c.Pull(ctx, 1<<62)
		if err != nil {
			b.Fatal(err)
		}
		if !p.HasMore {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	p, err := c.Pull(ctx, 0)
	if err != nil || len(p.JobLogs) == 0 {
		b.Fatalf("first page: %v", err)
	}
	first := p.JobLogs[0].Timestamp
	end, err := c.Pull(ctx, 1<<62)
	if err != nil {
		b.Fatal(err)
	}
	span := max(end.LastUpdated-first, 1)
	b.ResetTimer()
	var worst time.Duration
	var bytes int
	for i := 0; i < b.N; i++ {
		ts := first + span*int64(i%97)/97
		start := time.Now()
		q, err := c.Pull(ctx, ts)
		worst = max(worst, time.Since(start))
		if err != nil {
			b.Fatal(err)
		}
		for _, l := range q.JobLogs {
			bytes += len(l.Message)
		}
	}
	b.StopTimer()
	if bytes == 0 {
		b.Fatal("pages carried no logs")
	}
	b.ReportMetric(float64(worst.Microseconds())/1000, "worst-page-ms")
	b.ReportMetric(float64(bytes)/float64(b.N)/1024, "KiB/page")
	b.ReportMetric(float64(readRSS(pid))/1024, "rss-MiB")
}
