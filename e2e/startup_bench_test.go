package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/mount"
	"github.com/docker/docker/client"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/e2e/testenv"
	"github.com/tandem-run/tandem/shim/task"
)

// Start-up against bare Docker (issue 30). The same engine, image, program
// and container shape on both sides: the real dstack-runner (static, it
// answers HTTP) in the busybox image, host network, its dir and binary
// bound in, with an init. Bare Docker is create + start by the Engine API
// to the runner's first healthcheck answer; the shim is POST /api/tasks to
// the same answer. Both poll every millisecond, in alternating order.

// untilHealthy polls the runner's healthcheck until it answers 200.
func untilHealthy(port string, timeout time.Duration) error {
	hc := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(timeout)
	for {
		r, err := hc.Get("http://127.0.0.1:" + port + "/api/healthcheck")
		if err == nil {
			r.Body.Close()
			if r.StatusCode == http.StatusOK {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("runner on port %s never answered: %v", port, err)
		}
		time.Sleep(time.Millisecond)
	}
}

// runnerArgs are the arguments the shim gives the runner in host mode.
func runnerArgs(dir, httpPort, sshPort string) []string {
	return []string{"--log-level", "info", "start", "--temp-dir", dir, "--http-port", httpPort, "--ssh-port", sshPort, "--http-address", "localhost"}
}

// taskTiming is the shim's "task running" line (slog writes durations as
// nanoseconds; JSON keys match the fields case-insensitively).
type taskTiming struct {
	Msg                                                 string `json:"msg"`
	TaskID                                              string `json:"task_id"`
	Record, Prepare, Pull, Create, Start, Commit, Total time.Duration
}

func readTimings(b *testing.B, path string) map[string]taskTiming {
	b.Helper()
	f, err := os.Open(path)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	out := map[string]taskTiming{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		var t taskTiming
		if json.Unmarshal(sc.Bytes(), &t) == nil && t.Msg == "task running" {
			out[t.TaskID] = t
		}
	}
	return out
}

func BenchmarkTaskStartVsDocker(b *testing.B) {
	bins := testenv.Binaries(b)
	_, httpPort, _ := net.SplitHostPort(testenv.FreeAddr(b))
	_, sshPort, _ := net.SplitHostPort(testenv.FreeAddr(b))
	h := startShimTB(b, bins.Runner, nil, "--runner-http-port", httpPort, "--runner-ssh-port", sshPort, "--log-format", "json")
	dc, err := client.NewClientWithOpts(client.FromEnv, client.WithAPIVersionNegotiation())
	if err != nil {
		b.Fatal(err)
	}
	defer dc.Close()
	ctx := context.Background()
	init := true

	// Both sides poll from the first call on, as a client that cannot see
	// inside either would: the polling competes for the same CPUs.
	bare := func() (create, start, answer time.Duration) {
		dir := b.TempDir()
		began := time.Now()
		answered := make(chan error, 1)
		go func() { answered <- untilHealthy(httpPort, 30*time.Second) }()
		resp, err := dc.ContainerCreate(ctx, &container.Config{
			Image: h.image, Entrypoint: []string{task.RunnerBinaryInContainer},
			Cmd:    runnerArgs(task.RunnerDirInContainer, httpPort, sshPort),
			Labels: map[string]string{"bench": "bare"},
		}, &container.HostConfig{NetworkMode: "host", Init: &init, Mounts: []mount.Mount{
			{Type: mount.TypeBind, Source: dir, Target: task.RunnerDirInContainer},
			{Type: mount.TypeBind, Source: bins.Runner, Target: task.RunnerBinaryInContainer, ReadOnly: true},
		}}, nil, nil, randomID("bare"))
		if err != nil {
			b.Fatal(err)
		}
		create = time.Since(began)
		defer func() { _ = dc.ContainerRemove(ctx, resp.ID, container.RemoveOptions{Force: true}) }()
		if err := dc.ContainerStart(ctx, resp.ID, container.StartOptions{}); err != nil {
			b.Fatal(err)
		}
		start = time.Since(began) - create
		if err := <-answered; err != nil {
			b.Fatal(err)
		}
		return create, start, time.Since(began)
	}
	shim := func() (submit, answer time.Duration, id string) {
		began := time.Now()
		answered := make(chan error, 1)
		go func() { answered <- untilHealthy(httpPort, 30*time.Second) }()
		cfg := h.submit(api.TaskConfig{NetworkMode: "host"})
		submit = time.Since(began)
		if err := <-answered; err != nil {
			b.Fatal(err)
		}
		answer = time.Since(began)
		if _, err := h.client.TerminateTask(ctx, cfg.ID, api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser, Timeout: 0}); err != nil {
			b.Fatal(err)
		}
		h.wait(cfg.ID, time.Minute, func(i api.TaskInfoResponse) bool { return i.Status == api.TaskTerminated })
		if err := h.client.RemoveTask(ctx, cfg.ID); err != nil {
			b.Fatal(err)
		}
		return submit, answer, cfg.ID
	}
	// One warm-up of each: the first start after the shim released its
	// start-up pages reads them back (see common/memtrim).
	bare()
	shim()

	var bCreate, bStart, bAnswer, sSubmit, sAnswer []time.Duration
	var ids []string
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if i%2 == 0 {
			c, s, a := bare()
			bCreate, bStart, bAnswer = append(bCreate, c), append(bStart, s), append(bAnswer, a)
		}
		sub, ans, id := shim()
		sSubmit, sAnswer, ids = append(sSubmit, sub), append(sAnswer, ans), append(ids, id)
		if i%2 == 1 {
			c, s, a := bare()
			bCreate, bStart, bAnswer = append(bCreate, c), append(bStart, s), append(bAnswer, a)
		}
	}
	b.StopTimer()
	timings := readTimings(b, filepath.Join(h.home, "shim.log"))
	var record, prepare, pull, create, start, commit, total []time.Duration
	for _, id := range ids {
		t, ok := timings[id]
		if !ok {
			b.Fatalf("no timing line for task %s", id)
		}
		record, prepare, pull = append(record, t.Record), append(prepare, t.Prepare), append(pull, t.Pull)
		create, start, commit = append(create, t.Create), append(start, t.Start), append(commit, t.Commit)
		total = append(total, t.Total)
	}
	b.ReportMetric(median(bCreate), "bare-create-ms")
	b.ReportMetric(median(bStart), "bare-start-ms")
	b.ReportMetric(median(bAnswer), "bare-to-answer-ms")
	b.ReportMetric(median(sSubmit), "shim-post-ms")
	b.ReportMetric(median(sAnswer), "shim-to-answer-ms")
	b.ReportMetric(median(sAnswer)/median(bAnswer), "shim/bare-ratio")
	b.ReportMetric(median(record), "shim-record-ms")
	b.ReportMetric(median(prepare), "shim-prepare-ms")
	b.ReportMetric(median(pull), "shim-pull-check-ms")
	b.ReportMetric(median(create), "shim-create-ms")
	b.ReportMetric(median(start), "shim-start-ms")
	b.ReportMetric(median(commit), "shim-commit-ms")
	b.ReportMetric(median(total), "shim-submit-to-running-ms")
	target(b, "task start vs bare Docker", median(sAnswer)/median(bAnswer), "<=", 1.05)
}

// BenchmarkRunnerStart: the runner alone, run on the host: exec to its API
// answering, and its RSS idle 3 s later.
func BenchmarkRunnerStart(b *testing.B) {
	bins := testenv.Binaries(b)
	var took []time.Duration
	var rss int
	for i := 0; i < b.N; i++ {
		_, httpPort, _ := net.SplitHostPort(testenv.FreeAddr(b))
		_, sshPort, _ := net.SplitHostPort(testenv.FreeAddr(b))
		cmd := exec.Command(bins.Runner, runnerArgs(b.TempDir(), httpPort, sshPort)...)
		testenv.Isolate(cmd)
		began := time.Now()
		if err := cmd.Start(); err != nil {
			b.Fatal(err)
		}
		if err := untilHealthy(httpPort, 10*time.Second); err != nil {
			b.Fatal(err)
		}
		took = append(took, time.Since(began))
		if i == 0 {
			time.Sleep(3 * time.Second)
			rss = rssKiB(b, cmd.Process.Pid)
		}
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}
	b.ReportMetric(median(took), "exec-to-api-ms")
	b.ReportMetric(float64(rss)/1024, "idle-rss-MiB")
}

// BenchmarkShimRSS: the shim's RSS idle (no call for 8 s after start),
// after 120 API calls of the kinds the server makes, and with 10 running
// tasks (the real runner waiting for its job in each). One round whatever
// b.N is: it takes 30 s and RSS does not need a median.
func BenchmarkShimRSS(b *testing.B) {
	bins := testenv.Binaries(b)
	for range 1 {
		// At info, as a host runs it (the harness's default is debug).
		h := startShimTB(b, bins.Runner, nil, "--shim-log-level", "info")
		time.Sleep(8 * time.Second)
		idle := rssKiB(b, h.cmd.Process.Pid)
		ctx := context.Background()
		for j := 0; j < 40; j++ {
			if _, err := h.client.Healthcheck(ctx); err != nil {
				b.Fatal(err)
			}
			if _, err := h.client.ListTasks(ctx); err != nil {
				b.Fatal(err)
			}
			if _, err := h.client.InstanceHealth(ctx); err != nil {
				b.Fatal(err)
			}
		}
		time.Sleep(2 * time.Second)
		polled := rssKiB(b, h.cmd.Process.Pid)
		var ids []string
		for j := 0; j < 10; j++ {
			ids = append(ids, h.submit(api.TaskConfig{NetworkMode: "bridge"}).ID)
		}
		for _, id := range ids {
			h.wait(id, time.Minute, func(i api.TaskInfoResponse) bool { return i.Status == api.TaskRunning })
		}
		time.Sleep(5 * time.Second)
		tasks := rssKiB(b, h.cmd.Process.Pid)
		for _, id := range ids {
			_, _ = h.client.TerminateTask(ctx, id, api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser})
		}
		for _, id := range ids {
			h.wait(id, time.Minute, func(i api.TaskInfoResponse) bool { return i.Status == api.TaskTerminated })
			_ = h.client.RemoveTask(ctx, id)
		}
		b.ReportMetric(float64(idle)/1024, "idle-rss-MiB")
		target(b, "shim idle RSS MiB", float64(idle)/1024, "<=", 12)
		b.ReportMetric(float64(polled)/1024, "after-120-calls-rss-MiB")
		b.ReportMetric(float64(tasks)/1024, "10-tasks-rss-MiB")
		b.Logf("shim pid %s: idle %d KiB, after calls %d KiB, with 10 tasks %d KiB", strconv.Itoa(h.cmd.Process.Pid), idle, polled, tasks)
	}
}
