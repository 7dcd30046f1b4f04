package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/procs"
	"github.com/tandem-run/tandem/e2e/testenv"
)

// Issue 19: agents a platform engineer can watch.

func requireTool(t *testing.T, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		if testenv.InCI() {
			t.Fatalf("%s missing (make deps installs it)", name)
		}
		t.Skipf("%s missing", name)
	}
	return p
}

func shimMetrics(t *testing.T, h *shimHarness) string {
	t.Helper()
	resp, err := http.Get(strings.TrimSuffix(h.client.BaseURL(), "/") + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("/metrics: %d %s", resp.StatusCode, b)
	}
	return string(b)
}

// promQuery asks Prometheus's HTTP API for one instant vector.
func promQuery(t *testing.T, addr, q string) []float64 {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/api/v1/query?query=" + url.QueryEscape(q))
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	var r struct {
		Data struct {
			Result []struct {
				Value [2]any `json:"value"`
			} `json:"result"`
		} `json:"data"`
	}
	if json.NewDecoder(resp.Body).Decode(&r) != nil {
		return nil
	}
	var out []float64
	for _, s := range r.Data.Result {
		if str, ok := s.Value[1].(string); ok {
			if v, err := strconv.ParseFloat(str, 64); err == nil {
				out = append(out, v)
			}
		}
	}
	return out
}

// TestShimMetricsScrapedByPrometheus: Debian's real Prometheus scrapes a
// shim through a task's life; its query API returns the expected series,
// and promtool accepts the exposition.
func TestShimMetricsScrapedByPrometheus(t *testing.T) {
	t.Parallel()
	prom := requireTool(t, "prometheus")
	promtool := requireTool(t, "promtool")
	h := startShim(t, runnerScript(t, "sleep 600"), nil)
	target := h.addr()

	dir := t.TempDir()
	cfg := fmt.Sprintf("global:\n  scrape_interval: 200ms\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: shim\n    scrape_interval: 200ms\n    scrape_timeout: 150ms\n    static_configs:\n      - targets: [%q]\n", target)
	if err := os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	addr := testenv.FreeAddr(t)
	cmd := exec.Command(prom, "--config.file="+filepath.Join(dir, "prometheus.yml"), "--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+addr)
	logf, _ := os.Create(filepath.Join(dir, "prometheus.log"))
	cmd.Stdout, cmd.Stderr = logf, logf
	t.Cleanup(func() { logf.Close() })
	testenv.StartDaemon(t, cmd)

	ctx := context.Background()
	task := h.submit(api.TaskConfig{})
	h.wait(task.ID, time.Minute, running)
	// Prometheus sees the running task before it goes.
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if v := promQuery(t, addr, `tandem_shim_tasks{status="running"}`); len(v) == 1 && v[0] == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("Prometheus never saw the running task")
		}
	}
	if _, err := h.client.TerminateTask(ctx, task.ID, api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByServer}); err != nil {
		t.Fatal(err)
	}
	if err := h.client.RemoveTask(ctx, task.ID); err != nil {
		t.Fatal(err)
	}

	raw := shimMetrics(t, h)
	check := exec.Command(promtool, "check", "metrics")
	check.Stdin = strings.NewReader(raw)
	if out, err := check.CombinedOutput(); err != nil {
		t.Fatalf("promtool check metrics: %v\n%s", err, out)
	}
	want := map[string]func([]float64) bool{
		`tandem_shim_task_submissions_total`:                             func(v []float64) bool { return len(v) == 1 && v[0] == 1 },
		`tandem_shim_task_ends_total{reason="terminated_by_server"}`:     func(v []float64) bool { return len(v) == 1 && v[0] == 1 },
		`tandem_shim_tasks{status="running"}`:                            func(v []float64) bool { return len(v) == 1 && v[0] == 0 },
		`tandem_shim_task_submit_to_running_seconds_count`:               func(v []float64) bool { return len(v) == 1 && v[0] == 1 },
		`tandem_shim_http_requests_total{route="/api/tasks",code="200"}`: func(v []float64) bool { return len(v) >= 1 && v[0] >= 1 },
		`tandem_shim_http_requests_total{route="/api/tasks/:id/remove"}`: func(v []float64) bool { return len(v) == 1 && v[0] == 1 },
		`tandem_shim_recovery_duration_seconds`:                          func(v []float64) bool { return len(v) == 1 },
		`process_open_fds`:                                               func(v []float64) bool { return len(v) == 1 && v[0] > 0 },
		`max_over_time(tandem_shim_tasks{status="running"}[5m])`:         func(v []float64) bool { return len(v) == 1 && v[0] == 1 },
	}
	deadline := time.Now().Add(60 * time.Second)
	for q, ok := range want {
		for {
			v := promQuery(t, addr, q)
			if ok(v) {
				break
			}
			if time.Now().After(deadline) {
				b, _ := os.ReadFile(filepath.Join(dir, "prometheus.log"))
				t.Fatalf("Prometheus query %s = %v\nshim exposition:\n%s\nprometheus log tail:\n%s", q, v, tailStr(raw, 1500), tailStr(string(b), 1500))
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	if strings.Contains(raw, task.ID) {
		t.Fatal("a task id leaked into metric labels")
	}
}

// TestShimNotifiesSystemd: with NOTIFY_SOCKET and a watchdog, the shim
// sends READY=1 once it serves and recovered, WATCHDOG=1 while alive, and
// STOPPING=1 on shutdown, in that order.
func TestShimNotifiesSystemd(t *testing.T) {
	t.Parallel()
	sock := filepath.Join(t.TempDir(), "notify.sock")
	ln, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: sock, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	got := make(chan string, 64)
	go func() {
		buf := make([]byte, 256)
		for {
			n, err := ln.Read(buf)
			if err != nil {
				return
			}
			got <- string(buf[:n])
		}
	}()
	h := startShim(t, runnerScript(t, "sleep 60"), []string{"NOTIFY_SOCKET=" + sock, "WATCHDOG_USEC=400000"})
	next := func() string {
		select {
		case m := <-got:
			return m
		case <-time.After(10 * time.Second):
			return "(nothing)"
		}
	}
	if m := next(); m != "READY=1" {
		t.Fatalf("first message %q, want READY=1", m)
	}
	if m := next(); m != "WATCHDOG=1" {
		t.Fatalf("then %q, want WATCHDOG=1", m)
	}
	if err := h.client.Shutdown(context.Background(), false); err != nil {
		t.Fatal(err)
	}
	for {
		m := next()
		if m == "WATCHDOG=1" {
			continue
		}
		if m != "STOPPING=1" {
			t.Fatalf("on shutdown %q, want STOPPING=1", m)
		}
		break
	}
}

// TestShimJSONLogs: with --log-format json every line of shim.log is one
// JSON object jq accepts, and task lines carry task_id.
func TestShimJSONLogs(t *testing.T) {
	t.Parallel()
	jq := requireTool(t, "jq")
	h := startShim(t, runnerScript(t, "exit 0"), nil, "--log-format", "json")
	task := h.submit(api.TaskConfig{})
	h.wait(task.ID, time.Minute, terminated)
	b, err := os.ReadFile(filepath.Join(h.home, "shim.log"))
	if err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	lines, withTask := 0, 0
	for sc.Scan() {
		lines++
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("line %d is not JSON: %q", lines, sc.Text())
		}
		if m["task_id"] == task.ID {
			withTask++
		}
	}
	cmd := exec.Command(jq, "-e", ".level and .msg")
	cmd.Stdin = bytes.NewReader(b)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("jq: %v %s", err, tailStr(string(out), 500))
	}
	if lines == 0 || withTask == 0 {
		t.Fatalf("%d lines, %d with task_id", lines, withTask)
	}
}

// The shim raises its CPU priority at start (--shim-nice, default -10),
// every thread of it, so its API answers while Docker and the jobs keep
// every CPU busy; the jobs it starts (Docker's children, not its own) stay
// at the default; TANDEM_SHIM_NICE=0 leaves the shim's alone.
func TestShimCPUPriority(t *testing.T) {
	t.Parallel()
	h := startShim(t, runnerScript(t, "exec sleep 3600"), nil)
	if nices := threadNices(t, h.cmd.Process.Pid); len(nices) == 0 || slices.ContainsFunc(nices, func(n int) bool { return n != -10 }) {
		t.Fatalf("the shim's threads at nice %v, want all -10", nices)
	}
	cfg := h.submit(api.TaskConfig{})
	h.wait(cfg.ID, time.Minute, running)
	out, err := testenv.Docker(context.Background(), "inspect", "-f", "{{.State.Pid}}", h.names[0])
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(out))
	if err != nil {
		t.Fatalf("container pid %q: %v", out, err)
	}
	if nices := threadNices(t, pid); len(nices) == 0 || slices.ContainsFunc(nices, func(n int) bool { return n != 0 }) {
		t.Fatalf("the job's process at nice %v, want 0 (the default)", nices)
	}

	off := startShim(t, runnerScript(t, "exit 0"), []string{"TANDEM_SHIM_NICE=0"})
	if nices := threadNices(t, off.cmd.Process.Pid); slices.ContainsFunc(nices, func(n int) bool { return n != 0 }) {
		t.Fatalf("TANDEM_SHIM_NICE=0: the shim's threads at nice %v, want 0", nices)
	}
}

// threadNices is the nice value of each thread of pid (/proc stat field 19).
func threadNices(t *testing.T, pid int) []int {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/task", pid)
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, e := range entries {
		f, err := procs.StatFields(filepath.Join(dir, e.Name()))
		if err != nil {
			continue // the thread ended
		}
		if len(f) < 17 {
			t.Fatalf("thread %s: %d stat fields", e.Name(), len(f)+2)
		}
		n, err := strconv.Atoi(f[16])
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, n)
	}
	return out
}
