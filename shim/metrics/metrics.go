// Package metrics is the shim's own Prometheus endpoint (/metrics): what a
// platform engineer watches on a fleet of hosts. Names carry the
// tandem_shim_ prefix and their unit; labels stay low-cardinality (status,
// reason, route, code, component; never a task id). Per-task GPU metrics
// stay at /metrics/tasks/{id}, in DCGM's shape, as dstack reads them.
package metrics

import (
	"bufio"
	"net/http"
	"strconv"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/httpapi"
)

// Sources are what the handler reads at scrape time: the task engine and
// the GPU locks (either may be nil).
type Sources struct {
	Tasks interface{ List() []api.TaskListItem }
	GPUs  interface {
		Total() int
		Free() int
	}
}

// Metrics holds the shim's series. It implements task.Observer and the
// volume and component observers.
type Metrics struct {
	// proc is /proc/self and stat /proc/stat (tests point them at fixtures).
	proc, stat string

	submitted        *family
	ended            *family
	submitToRunning  *family
	pullBytes        *family
	pullSeconds      *family
	requests         *family
	requestSeconds   *family
	recoverySeconds  *family
	recoveryTasks    *family
	volumeMounts     *family
	componentInstall *family
}

// statuses are every task status, so each series exists from the start.
var statuses = []api.TaskStatus{api.TaskPending, api.TaskPreparing, api.TaskPulling, api.TaskCreating, api.TaskRunning, api.TaskTerminated}

// defBuckets are Prometheus' default latency buckets.
var defBuckets = []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10}

// New makes the series; the process and Go runtime ones are read at scrape.
func New() *Metrics {
	m := &Metrics{proc: "/proc/self", stat: "/proc/stat",
		submitted: newFamily("tandem_shim_task_submissions_total", "Tasks accepted by POST /api/tasks.", counter, nil),
		ended:     newFamily("tandem_shim_task_ends_total", "Tasks that ended, by termination reason.", counter, nil, "reason"),
		submitToRunning: newFamily("tandem_shim_task_submit_to_running_seconds", "Time from submit to a running container.", histogram,
			[]float64{0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900}),
		pullBytes: newFamily("tandem_shim_image_pull_bytes_total", "Bytes downloaded by image pulls.", counter, nil),
		pullSeconds: newFamily("tandem_shim_image_pull_duration_seconds", "Image pull durations, by result.", histogram,
			[]float64{0.5, 1, 5, 15, 30, 60, 120, 300, 600, 1800}, "result"),
		requests:         newFamily("tandem_shim_http_requests_total", "API requests, by route and status code.", counter, nil, "route", "code"),
		requestSeconds:   newFamily("tandem_shim_http_request_duration_seconds", "API request latency, by route.", histogram, defBuckets, "route"),
		recoverySeconds:  newFamily("tandem_shim_recovery_duration_seconds", "How long the last start's task recovery took.", gauge, nil),
		recoveryTasks:    newFamily("tandem_shim_recovery_tasks", "Tasks the last start's recovery handled, by decision.", gauge, nil, "action"),
		volumeMounts:     newFamily("tandem_shim_volume_mounts_total", "Volume mount attempts, by result (mounted, formatted, refused).", counter, nil, "result"),
		componentInstall: newFamily("tandem_shim_component_installs_total", "Component installs, by component and result.", counter, nil, "component", "result"),
	}
	// Series without labels exist from the start, as client_golang's do.
	for _, f := range []*family{m.submitted, m.submitToRunning, m.pullBytes, m.recoverySeconds} {
		f.add(0)
	}
	for _, r := range []string{"mounted", "formatted", "refused"} {
		m.volumeMounts.add(0, r)
	}
	return m
}

// Handler serves the series in Prometheus text format (0.0.4), with the
// gauges read from src at each scrape. It is made once the sources exist
// (the engine takes the Metrics as its observer first).
func (m *Metrics) Handler(src Sources) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		_ = flushTo(w, func(w *bufio.Writer) { m.write(w, src) })
	})
}

// write writes every family: ours, the task and GPU gauges read now, then
// the process and runtime ones. A /proc read that fails leaves its series
// at 0 rather than failing the scrape.
func (m *Metrics) write(w *bufio.Writer, src Sources) {
	for _, f := range []*family{m.submitted, m.ended, m.submitToRunning, m.pullBytes, m.pullSeconds, m.requests,
		m.requestSeconds, m.recoverySeconds, m.recoveryTasks, m.volumeMounts, m.componentInstall} {
		f.write(w)
	}
	counts := map[api.TaskStatus]int{}
	if src.Tasks != nil {
		for _, t := range src.Tasks.List() {
			counts[t.Status]++
		}
	}
	header(w, "tandem_shim_tasks", "Tasks the shim holds, by status.", gauge)
	for _, st := range statuses {
		sample(w, "tandem_shim_tasks", []string{"status"}, []string{string(st)}, "", "", float64(counts[st]))
	}
	if src.GPUs != nil {
		total, free := src.GPUs.Total(), src.GPUs.Free()
		header(w, "tandem_shim_gpus", "GPUs on the host, by state (total, allocated).", gauge)
		sample(w, "tandem_shim_gpus", []string{"state"}, []string{"allocated"}, "", "", float64(total-free))
		sample(w, "tandem_shim_gpus", []string{"state"}, []string{"total"}, "", "", float64(total))
	}
	p, _ := readProc(m.proc, m.stat)
	writeProcess(w, p)
	writeRuntime(w)
}

// Middleware counts API requests by route pattern (never the raw path:
// ids would explode the label set) and status code.
func (m *Metrics) Middleware() echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			start := time.Now()
			err := next(c)
			route := c.Path()
			if route == "" {
				route = "unmatched"
			}
			code := c.Response().Status
			if err != nil {
				code = httpapi.StatusFor(c, err)
			}
			m.requests.add(1, route, strconv.Itoa(code))
			m.requestSeconds.observe(time.Since(start).Seconds(), route)
			return err
		}
	}
}

// TaskSubmitted implements task.Observer.
func (m *Metrics) TaskSubmitted() { m.submitted.add(1) }

// TaskRunning implements task.Observer.
func (m *Metrics) TaskRunning(d time.Duration) { m.submitToRunning.observe(d.Seconds()) }

// TaskEnded implements task.Observer.
func (m *Metrics) TaskEnded(reason api.TerminationReason) {
	m.ended.add(1, string(reason))
}

// ImagePulled implements task.Observer.
func (m *Metrics) ImagePulled(n int64, took time.Duration, err error) {
	m.pullBytes.add(float64(max(n, 0)))
	result := "ok"
	if err != nil {
		result = "failed"
	}
	m.pullSeconds.observe(took.Seconds(), result)
}

// Recovered implements task.Observer.
func (m *Metrics) Recovered(took time.Duration, actions map[string]int) {
	m.recoverySeconds.set(took.Seconds())
	m.recoveryTasks.reset()
	for a, n := range actions {
		m.recoveryTasks.set(float64(n), a)
	}
}

// VolumeMount records a mount attempt's result.
func (m *Metrics) VolumeMount(result string) { m.volumeMounts.add(1, result) }

// ComponentInstalled records an install's result.
func (m *Metrics) ComponentInstalled(component string, err error) {
	result := "ok"
	if err != nil {
		result = "failed"
	}
	m.componentInstall.add(1, component, result)
}
