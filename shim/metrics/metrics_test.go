package metrics

import (
	"bufio"
	"bytes"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/labstack/echo/v4"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/tandem-run/tandem/api"
)

// fixture is a Metrics with src for its scrapes and /proc fixtures.
type fixtureMetrics struct {
	*Metrics
	src Sources
}

func fixture(src Sources) fixtureMetrics {
	m := fixtureMetrics{Metrics: New(), src: src}
	m.proc, m.stat = "testdata/proc/self", "testdata/proc/stat"
	return m
}

// scrape parses the exposition with Prometheus' own parser, so what we
// write by hand is held to what a real scraper accepts.
func scrape(t *testing.T, m fixtureMetrics) (map[string]*dto.MetricFamily, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	m.Handler(m.src).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	if ct := rec.Header().Get("Content-Type"); !strings.HasPrefix(ct, "text/plain; version=0.0.4") {
		t.Fatalf("content type %q", ct)
	}
	body := rec.Body.String()
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(body))
	if err != nil {
		t.Fatalf("parse: %v\n%s", err, body)
	}
	return fams, body
}

func value(t *testing.T, fams map[string]*dto.MetricFamily, name string, labels ...string) *dto.Metric {
	t.Helper()
	f := fams[name]
	if f == nil {
		t.Fatalf("no family %s", name)
	}
next:
	for _, m := range f.Metric {
		got := map[string]string{}
		for _, l := range m.Label {
			got[l.GetName()] = l.GetValue()
		}
		for i := 0; i+1 < len(labels); i += 2 {
			if got[labels[i]] != labels[i+1] {
				continue next
			}
		}
		return m
	}
	t.Fatalf("no series %s%v", name, labels)
	return nil
}

func TestExposition(t *testing.T) {
	tasks := []api.TaskListItem{{ID: "a", Status: api.TaskRunning}, {ID: "b", Status: api.TaskRunning}, {ID: "c", Status: api.TaskPulling}}
	m := fixture(Sources{Tasks: taskList(tasks), GPUs: gpuCounts{total: 8, free: 5}})
	m.TaskSubmitted()
	m.TaskSubmitted()
	m.TaskRunning(300 * time.Millisecond)
	m.TaskRunning(2 * time.Second)
	m.TaskEnded(api.ReasonTerminatedByUser)
	m.ImagePulled(1000, 3*time.Second, nil)
	m.ImagePulled(-5, time.Second, errors.New("x"))
	m.Recovered(1500*time.Millisecond, map[string]int{"adopt": 2, "hold": 1})
	m.Recovered(time.Second, map[string]int{"adopt": 3})
	m.VolumeMount("formatted")
	m.ComponentInstalled(string(api.ComponentRunner), nil)

	fams, body := scrape(t, m)
	checks := []struct {
		name   string
		labels []string
		want   float64
	}{
		{"tandem_shim_task_submissions_total", nil, 2},
		{"tandem_shim_task_ends_total", []string{"reason", "terminated_by_user"}, 1},
		{"tandem_shim_image_pull_bytes_total", nil, 1000},
		{"tandem_shim_recovery_duration_seconds", nil, 1},
		{"tandem_shim_recovery_tasks", []string{"action", "adopt"}, 3},
		{"tandem_shim_volume_mounts_total", []string{"result", "formatted"}, 1},
		{"tandem_shim_volume_mounts_total", []string{"result", "refused"}, 0},
		{"tandem_shim_component_installs_total", []string{"component", "dstack-runner", "result", "ok"}, 1},
		{"tandem_shim_tasks", []string{"status", "running"}, 2},
		{"tandem_shim_tasks", []string{"status", "pulling"}, 1},
		{"tandem_shim_tasks", []string{"status", "terminated"}, 0},
		{"tandem_shim_gpus", []string{"state", "total"}, 8},
		{"tandem_shim_gpus", []string{"state", "allocated"}, 3},
		{"process_cpu_seconds_total", nil, 3.8},
		{"process_open_fds", nil, 4},
		{"process_max_fds", nil, 1048576},
		{"process_start_time_seconds", nil, 1763900015},
		{"process_virtual_memory_bytes", nil, 734003200},
		{"go_threads", nil, 9},
	}
	for _, c := range checks {
		s := value(t, fams, c.name, c.labels...)
		var got float64
		switch {
		case s.Counter != nil:
			got = s.Counter.GetValue()
		case s.Gauge != nil:
			got = s.Gauge.GetValue()
		case s.Untyped != nil:
			got = s.Untyped.GetValue()
		}
		if got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	if fams["tandem_shim_recovery_tasks"] != nil && len(fams["tandem_shim_recovery_tasks"].Metric) != 1 {
		t.Errorf("recovery series from an earlier start stayed: %v", fams["tandem_shim_recovery_tasks"].Metric)
	}
	h := value(t, fams, "tandem_shim_task_submit_to_running_seconds").Histogram
	if h.GetSampleCount() != 2 || h.GetSampleSum() != 2.3 {
		t.Errorf("histogram count %d sum %v", h.GetSampleCount(), h.GetSampleSum())
	}
	for _, b := range h.Bucket {
		want := uint64(0)
		switch {
		case b.GetUpperBound() >= 2.5:
			want = 2
		case b.GetUpperBound() >= 0.5:
			want = 1
		}
		if b.GetCumulativeCount() != want {
			t.Errorf("bucket le=%v: %d, want %d", b.GetUpperBound(), b.GetCumulativeCount(), want)
		}
	}
	pull := value(t, fams, "tandem_shim_image_pull_duration_seconds", "result", "failed").Histogram
	if pull.GetSampleCount() != 1 {
		t.Errorf("failed pulls: %d", pull.GetSampleCount())
	}
	for _, name := range []string{"go_goroutines", "go_memstats_heap_alloc_bytes", "go_memstats_sys_bytes", "go_gc_cycles_total", "go_info"} {
		value(t, fams, name)
	}
	if fams["tandem_shim_task_submissions_total"].GetType() != dto.MetricType_COUNTER ||
		fams["tandem_shim_tasks"].GetType() != dto.MetricType_GAUGE {
		t.Error("wrong family types")
	}
	// Two scrapes of one state are byte-identical but for the live
	// process and runtime figures.
	_, again := scrape(t, m)
	cut := func(s string) string { return s[:strings.Index(s, "# HELP process_cpu_seconds_total")] }
	if cut(body) != cut(again) {
		t.Error("exposition order is not stable")
	}
}

func TestMiddlewareCountsRoutesNotPaths(t *testing.T) {
	m := fixture(Sources{})
	e := echo.New()
	e.Use(m.Middleware())
	e.GET("/api/tasks/:id", func(c echo.Context) error { return c.String(200, "ok") })
	for _, p := range []string{"/api/tasks/zq7taskone", "/api/tasks/zq7tasktwo", "/nothing"} {
		e.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, p, nil))
	}
	fams, body := scrape(t, m)
	if got := value(t, fams, "tandem_shim_http_requests_total", "route", "/api/tasks/:id", "code", "200").Counter.GetValue(); got != 2 {
		t.Errorf("route count %v", got)
	}
	value(t, fams, "tandem_shim_http_requests_total", "code", "404")
	if strings.Contains(body, "zq7task") {
		t.Error("a raw path leaked into labels")
	}
}

func TestLabelEscaping(t *testing.T) {
	f := newFamily("x_total", "help with \\ and\nnewline", counter, nil, "l")
	f.add(1, "a\"b\\c\nd")
	f.add(1) // too few values: padded, not a panic
	var buf bytes.Buffer
	w := bufio.NewWriter(&buf)
	f.write(w)
	w.Flush()
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(buf.String()))
	if err != nil {
		t.Fatalf("%v\n%s", err, buf.String())
	}
	got := map[string]bool{}
	for _, m := range fams["x_total"].Metric {
		got[m.Label[0].GetValue()] = true
	}
	if !got["a\"b\\c\nd"] || !got[""] || fams["x_total"].GetHelp() != "help with \\ and\nnewline" {
		t.Errorf("round trip: %v %q", got, fams["x_total"].GetHelp())
	}
}

func TestReadProcMissing(t *testing.T) {
	if _, err := readProc(t.TempDir(), "/nonexistent"); err == nil {
		t.Fatal("no error for a missing stat")
	}
	// The scrape still succeeds with the process series at 0.
	m := fixtureMetrics{Metrics: New()}
	m.proc = t.TempDir()
	fams, _ := scrape(t, m)
	if v := value(t, fams, "process_open_fds").Gauge.GetValue(); v != 0 {
		t.Errorf("open fds %v", v)
	}
}

type taskList []api.TaskListItem

func (l taskList) List() []api.TaskListItem { return l }

type gpuCounts struct{ total, free int }

func (g gpuCounts) Total() int { return g.total }
func (g gpuCounts) Free() int  { return g.free }
