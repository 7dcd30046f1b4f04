// Package metrics is the shim's own Prometheus endpoint (/metrics): what a
// platform engineer watches on a fleet of hosts. Names carry the
// tandem_shim_ prefix and their unit; labels stay low-cardinality (status,
// reason, route, code, component; never a task id). Per-task GPU metrics
// stay at /metrics/tasks/{id}, in DCGM's shape, as dstack reads them.
package metrics

import (
	"net/http"
	"strconv"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/httpapi"
)

// Sources are read at scrape time.
type Sources struct {
	Tasks     func() []api.TaskListItem
	GPUsTotal func() int
	GPUsFree  func() int
}

// Metrics holds the shim's collectors. It implements task.Observer and the
// volume and component observers.
type Metrics struct {
	reg *prometheus.Registry

	submitted        prometheus.Counter
	ended            *prometheus.CounterVec
	submitToRunning  prometheus.Histogram
	pullBytes        prometheus.Counter
	pullSeconds      *prometheus.HistogramVec
	requests         *prometheus.CounterVec
	requestSeconds   *prometheus.HistogramVec
	recoverySeconds  prometheus.Gauge
	recoveryTasks    *prometheus.GaugeVec
	volumeMounts     *prometheus.CounterVec
	componentInstall *prometheus.CounterVec
}

// statuses are every task status, so each series exists from the start.
var statuses = []api.TaskStatus{api.TaskPending, api.TaskPreparing, api.TaskPulling, api.TaskCreating, api.TaskRunning, api.TaskTerminated}

// New registers the collectors, the Go and process ones included.
func New(src Sources) *Metrics {
	reg := prometheus.NewRegistry()
	m := &Metrics{reg: reg,
		submitted: prometheus.NewCounter(prometheus.CounterOpts{Name: "tandem_shim_task_submissions_total", Help: "Tasks accepted by POST /api/tasks."}),
		ended:     prometheus.NewCounterVec(prometheus.CounterOpts{Name: "tandem_shim_task_ends_total", Help: "Tasks that ended, by termination reason."}, []string{"reason"}),
		submitToRunning: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "tandem_shim_task_submit_to_running_seconds", Help: "Time from submit to a running container.",
			Buckets: []float64{0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900}}),
		pullBytes: prometheus.NewCounter(prometheus.CounterOpts{Name: "tandem_shim_image_pull_bytes_total", Help: "Bytes downloaded by image pulls."}),
		pullSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "tandem_shim_image_pull_duration_seconds", Help: "Image pull durations, by result.",
			Buckets: []float64{0.5, 1, 5, 15, 30, 60, 120, 300, 600, 1800}}, []string{"result"}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "tandem_shim_http_requests_total", Help: "API requests, by route and status code."}, []string{"route", "code"}),
		requestSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "tandem_shim_http_request_duration_seconds", Help: "API request latency, by route.",
			Buckets: prometheus.DefBuckets}, []string{"route"}),
		recoverySeconds:  prometheus.NewGauge(prometheus.GaugeOpts{Name: "tandem_shim_recovery_duration_seconds", Help: "How long the last start's task recovery took."}),
		recoveryTasks:    prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "tandem_shim_recovery_tasks", Help: "Tasks the last start's recovery handled, by decision."}, []string{"action"}),
		volumeMounts:     prometheus.NewCounterVec(prometheus.CounterOpts{Name: "tandem_shim_volume_mounts_total", Help: "Volume mount attempts, by result (mounted, formatted, refused)."}, []string{"result"}),
		componentInstall: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "tandem_shim_component_installs_total", Help: "Component installs, by component and result."}, []string{"component", "result"}),
	}
	reg.MustRegister(m.submitted, m.ended, m.submitToRunning, m.pullBytes, m.pullSeconds, m.requests, m.requestSeconds,
		m.recoverySeconds, m.recoveryTasks, m.volumeMounts, m.componentInstall,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		&scrape{src: src,
			tasks: prometheus.NewDesc("tandem_shim_tasks", "Tasks the shim holds, by status.", []string{"status"}, nil),
			gpus:  prometheus.NewDesc("tandem_shim_gpus", "GPUs on the host, by state (total, allocated).", []string{"state"}, nil)})
	for _, r := range []string{"mounted", "formatted", "refused"} {
		m.volumeMounts.WithLabelValues(r)
	}
	return m
}

// scrape reads the task table and GPU locks when Prometheus asks.
type scrape struct {
	src         Sources
	tasks, gpus *prometheus.Desc
}

func (s *scrape) Describe(ch chan<- *prometheus.Desc) { ch <- s.tasks; ch <- s.gpus }

func (s *scrape) Collect(ch chan<- prometheus.Metric) {
	counts := map[api.TaskStatus]int{}
	if s.src.Tasks != nil {
		for _, t := range s.src.Tasks() {
			counts[t.Status]++
		}
	}
	for _, st := range statuses {
		ch <- prometheus.MustNewConstMetric(s.tasks, prometheus.GaugeValue, float64(counts[st]), string(st))
	}
	if s.src.GPUsTotal != nil {
		total := s.src.GPUsTotal()
		free := total
		if s.src.GPUsFree != nil {
			free = s.src.GPUsFree()
		}
		ch <- prometheus.MustNewConstMetric(s.gpus, prometheus.GaugeValue, float64(total), "total")
		ch <- prometheus.MustNewConstMetric(s.gpus, prometheus.GaugeValue, float64(total-free), "allocated")
	}
}

// Handler serves the registry in Prometheus text format.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError})
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
				code = httpapi.Status(err)
			}
			m.requests.WithLabelValues(route, strconv.Itoa(code)).Inc()
			m.requestSeconds.WithLabelValues(route).Observe(time.Since(start).Seconds())
			return err
		}
	}
}

// TaskSubmitted implements task.Observer.
func (m *Metrics) TaskSubmitted() { m.submitted.Inc() }

// TaskRunning implements task.Observer.
func (m *Metrics) TaskRunning(d time.Duration) { m.submitToRunning.Observe(d.Seconds()) }

// TaskEnded implements task.Observer.
func (m *Metrics) TaskEnded(reason api.TerminationReason) {
	m.ended.WithLabelValues(string(reason)).Inc()
}

// ImagePulled implements task.Observer.
func (m *Metrics) ImagePulled(n int64, took time.Duration, err error) {
	m.pullBytes.Add(float64(max(n, 0)))
	result := "ok"
	if err != nil {
		result = "failed"
	}
	m.pullSeconds.WithLabelValues(result).Observe(took.Seconds())
}

// Recovered implements task.Observer.
func (m *Metrics) Recovered(took time.Duration, actions map[string]int) {
	m.recoverySeconds.Set(took.Seconds())
	m.recoveryTasks.Reset()
	for a, n := range actions {
		m.recoveryTasks.WithLabelValues(a).Set(float64(n))
	}
}

// VolumeMount records a mount attempt's result.
func (m *Metrics) VolumeMount(result string) { m.volumeMounts.WithLabelValues(result).Inc() }

// ComponentInstalled records an install's result.
func (m *Metrics) ComponentInstalled(component string, err error) {
	result := "ok"
	if err != nil {
		result = "failed"
	}
	m.componentInstall.WithLabelValues(component, result).Inc()
}
