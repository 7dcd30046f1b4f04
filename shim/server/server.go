// Package server is dstack-shim's HTTP API on echo. Handlers decode with the
// shared rules, call the engine and components, and map errors to statuses
// in one place (toHTTP).
package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/httpapi"
	"github.com/tandem-run/tandem/common/ident"
	"github.com/tandem-run/tandem/shim/component"
	"github.com/tandem-run/tandem/shim/runnerdir"
	"github.com/tandem-run/tandem/shim/task"
)

// Tasks is what the API needs from the task engine.
type Tasks interface {
	Submit(cfg api.TaskConfig) (api.TaskInfoResponse, error)
	Get(id string) (api.TaskInfoResponse, error)
	// GetFresh is Get with the job's final state looked for now (a GET
	// with Cache-Control: no-cache).
	GetFresh(id string) (api.TaskInfoResponse, error)
	List() []api.TaskListItem
	Terminate(ctx context.Context, id string, req api.TaskTerminateRequest) (api.TaskInfoResponse, error)
	Remove(ctx context.Context, id string) error
	// JobLog is the raw output the task's runner kept (Tandem's own route;
	// dstack's server never calls it).
	JobLog(id string) (io.ReadCloser, error)
	// GPUIDs are the GPUs a task holds (task.ErrNotFound for none).
	GPUIDs(id string) ([]string, error)
	// ImageConfig is the config of the image the task's container was
	// made from (Tandem's own route: tandem run IMAGE with no command).
	ImageConfig(ctx context.Context, id string) (api.TaskImageConfig, error)
}

// Instance answers for the host.
type Instance interface {
	Info() api.InstanceInfoResponse
	// Host says the host's name, addresses and GPU count.
	Host() (api.InstanceHostResponse, error)
	// Health returns the DCGM-shaped health, nil when there is none.
	Health(ctx context.Context) *api.DCGMHealth
}

// GPUMetrics renders a task's GPU metrics in DCGM's exposition; ok=false
// when there is no source.
type GPUMetrics interface {
	TaskMetrics(ctx context.Context, gpuIDs []string) (text string, ok bool, err error)
}

// Readiness holds task calls until the tasks are restored after a start;
// an error answers 503.
type Readiness interface {
	Ready(ctx context.Context) error
}

// Stopper stops the shim after POST /api/shutdown answered.
type Stopper interface {
	Stop(force bool)
}

// Components is what the API needs from a component manager.
type Components interface {
	Info(ctx context.Context) api.ComponentInfo
	StartInstall(ctx context.Context, url string, done func(error)) error
}

// Deps are the server's collaborators.
type Deps struct {
	Version       string
	TandemVersion string // Tandem's own release, beside the dstack version
	// RunnerHTTPPort is the host-network runners' API port, told in the
	// healthcheck (0: not told).
	RunnerHTTPPort int
	Tasks          Tasks
	Runner, Shim   Components
	// InstallCtx is cancelled on shutdown, ending background installs.
	InstallCtx context.Context
	// Instance answers /api/instance/* (nil: empty info and health, no
	// host: 404).
	Instance Instance
	// GPUMetrics serves /metrics/tasks/{id} (nil: 404).
	GPUMetrics GPUMetrics
	// Stopper is told after the 200 of a shutdown was sent (nil: nothing).
	Stopper Stopper
	// Metrics serves GET /metrics (nil: 404); MetricsMiddleware counts
	// requests (nil: none).
	Metrics           http.Handler
	MetricsMiddleware echo.MiddlewareFunc
	// Readiness holds task endpoints (bounded) until the tasks are
	// restored after a start (nil: always ready).
	Readiness Readiness
	// SubmitWait is how long a submit's answer may wait for its task to
	// run (when Tasks can say: settler); a task that needs a registry pull
	// is answered when the pull begins. 0: answered at once.
	SubmitWait time.Duration
	Log        *slog.Logger
}

// New returns the echo instance serving the shim API.
func New(d Deps) *echo.Echo {
	e := httpapi.NewEcho(d.Log)
	s := &srv{d: d}
	if d.MetricsMiddleware != nil {
		e.Use(d.MetricsMiddleware)
	}
	if d.Metrics != nil {
		e.GET("/metrics", echo.WrapHandler(d.Metrics))
	}
	e.GET("/api/healthcheck", s.healthcheck)
	e.POST("/api/shutdown", s.shutdown)
	e.GET("/api/instance/health", s.instanceHealth)
	e.GET("/api/instance/info", s.instanceInfo)
	e.GET("/api/instance/host", s.host)
	e.GET("/api/components", s.components)
	e.POST("/api/components/install", s.install)
	ready := s.ready
	e.GET("/api/tasks", s.listTasks, ready)
	e.POST("/api/tasks", s.submit, ready)
	e.GET("/api/tasks/:id", s.getTask, ready)
	e.POST("/api/tasks/:id/terminate", s.terminate, ready)
	e.POST("/api/tasks/:id/remove", s.remove, ready)
	e.GET("/api/tasks/:id/job-log", s.jobLog, ready)
	e.GET("/api/tasks/:id/image-config", s.imageConfig, ready)
	e.GET("/metrics/tasks/:id", s.metrics, ready)
	return e
}

type srv struct{ d Deps }

// ready holds task endpoints until recovery is done (503 past the bound).
func (s *srv) ready(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		if s.d.Readiness != nil {
			if err := s.d.Readiness.Ready(c.Request().Context()); err != nil {
				return toHTTP(err)
			}
		}
		return next(c)
	}
}

// toHTTP maps engine and component errors to API errors: the one place,
// for every route; an unknown task is dstack's "Not Found".
func toHTTP(err error) error { return mapError(err, "Not Found") }

// mapError is toHTTP with notFound the text of an unknown task's 404 (the
// task routes and /metrics/tasks word it differently in dstack's shim).
func mapError(err error, notFound string) error {
	var stopErr *task.StopError
	var noRoom *runnerdir.NoRoomError
	switch {
	case err == nil:
		return nil
	case errors.Is(err, task.ErrNotFound):
		return httpapi.Errorf(http.StatusNotFound, "%s", notFound)
	case errors.Is(err, task.ErrNotReady):
		return &httpapi.Error{Status: http.StatusServiceUnavailable, Message: task.ErrNotReady.Error()}
	case errors.Is(err, task.ErrInvalid):
		return &httpapi.Error{Status: http.StatusBadRequest, Message: trimClass(err, task.ErrInvalid)}
	case errors.As(err, &noRoom):
		// Its own text: what the home has and the rule, no path.
		return &httpapi.Error{Status: http.StatusInsufficientStorage, Message: noRoom.Error(), Err: err}
	case errors.Is(err, task.ErrStorage):
		// Said without the cause's path and wording (they are logged).
		return &httpapi.Error{Status: http.StatusInsufficientStorage, Message: task.ErrStorage.Error(), Err: err}
	case errors.Is(err, task.ErrConflict):
		return &httpapi.Error{Status: http.StatusConflict, Message: err.Error()}
	case errors.As(err, &stopErr):
		return httpapi.Internal("failed to stop the task's container", err)
	case errors.Is(err, component.ErrInstalling):
		return httpapi.Errorf(http.StatusConflict, "already installing")
	case errors.Is(err, component.ErrBackoff):
		return &httpapi.Error{Status: http.StatusConflict, Message: err.Error()}
	}
	return httpapi.Internal("the request failed", err)
}

// trimClass drops the "invalid task: " prefix: dstack's texts are bare.
func trimClass(err, class error) string {
	msg, prefix := err.Error(), class.Error()+": "
	if len(msg) > len(prefix) && msg[:len(prefix)] == prefix {
		return msg[len(prefix):]
	}
	return msg
}

// jobLog streams a task's kept output, also after its runner is gone.
func (s *srv) jobLog(c echo.Context) error {
	id := c.Param("id")
	if err := ident.TaskID(id); err != nil {
		return httpapi.Errorf(http.StatusBadRequest, "%v", err)
	}
	rc, err := s.d.Tasks.JobLog(id)
	if err != nil {
		return toHTTP(err)
	}
	defer rc.Close()
	c.Response().Header().Set(echo.HeaderContentType, "application/octet-stream")
	c.Response().WriteHeader(http.StatusOK)
	_, err = io.Copy(c.Response(), rc)
	return err
}

// imageConfig answers the config of the image a task's container was
// made from: 404 for no such task, 409 while it has no container.
func (s *srv) imageConfig(c echo.Context) error {
	id, err := taskID(c)
	if err != nil {
		return err
	}
	cfg, err := s.d.Tasks.ImageConfig(c.Request().Context(), id)
	if err != nil {
		return toHTTP(err)
	}
	return httpapi.JSON(c, cfg)
}

func (s *srv) healthcheck(c echo.Context) error {
	return httpapi.JSON(c, api.HealthcheckResponse{Service: api.ServiceShim, Version: s.d.Version, TandemVersion: s.d.TandemVersion, RunnerHTTPPort: s.d.RunnerHTTPPort})
}

func (s *srv) shutdown(c echo.Context) error {
	var req api.ShutdownRequest
	if err := httpapi.Bind(c, &req); err != nil {
		return err
	}
	if err := httpapi.OK(c); err != nil {
		return err
	}
	c.Response().Flush()
	if s.d.Stopper != nil {
		go s.d.Stopper.Stop(req.Force)
	}
	return nil
}

func (s *srv) instanceHealth(c echo.Context) error {
	var h *api.DCGMHealth
	if s.d.Instance != nil {
		h = s.d.Instance.Health(c.Request().Context())
	}
	return httpapi.JSON(c, api.InstanceHealthResponse{DCGM: h})
}

func (s *srv) instanceInfo(c echo.Context) error {
	var info api.InstanceInfoResponse
	if s.d.Instance != nil {
		info = s.d.Instance.Info()
	}
	return httpapi.JSON(c, info)
}

func (s *srv) host(c echo.Context) error {
	if s.d.Instance == nil {
		return echo.ErrNotFound
	}
	a, err := s.d.Instance.Host()
	if err != nil {
		return fmt.Errorf("host facts: %w", err)
	}
	return httpapi.JSON(c, a)
}

func (s *srv) components(c echo.Context) error {
	ctx := c.Request().Context()
	return httpapi.JSON(c, api.ComponentListResponse{Components: []api.ComponentInfo{s.d.Runner.Info(ctx), s.d.Shim.Info(ctx)}})
}

func (s *srv) install(c echo.Context) error {
	var req api.ComponentInstallRequest
	if err := httpapi.Bind(c, &req); err != nil {
		return err
	}
	var m Components
	switch {
	case req.Name == "":
		return httpapi.Errorf(http.StatusBadRequest, "empty name")
	case req.Name == api.ComponentRunner:
		m = s.d.Runner
	case req.Name == api.ComponentShim:
		m = s.d.Shim
	default:
		return httpapi.Errorf(http.StatusBadRequest, "unknown component")
	}
	if req.URL == "" {
		return httpapi.Errorf(http.StatusBadRequest, "empty url")
	}
	ctx := s.d.InstallCtx
	if ctx == nil {
		ctx = context.Background()
	}
	if err := m.StartInstall(ctx, req.URL, nil); err != nil {
		return toHTTP(err)
	}
	return httpapi.OK(c)
}

func (s *srv) listTasks(c echo.Context) error {
	return httpapi.JSON(c, api.TaskListResponse{Tasks: s.d.Tasks.List()})
}

func (s *srv) submit(c echo.Context) error {
	var cfg api.TaskConfig
	if err := httpapi.Bind(c, &cfg); err != nil {
		return err
	}
	info, err := s.d.Tasks.Submit(cfg)
	if err != nil {
		return toHTTP(err)
	}
	if st, ok := s.d.Tasks.(settler); ok && s.d.SubmitWait > 0 {
		if now, err := st.AwaitSettled(c.Request().Context(), cfg.ID, s.d.SubmitWait); err == nil {
			info = now
		}
	}
	return httpapi.JSON(c, info.SubmitResponse())
}

// settler is a task engine that can hold a submit's answer until the task
// runs (task.Engine.AwaitSettled): dstack's server then starts the job on
// its first look after the submit instead of one 5-10 s later.
type settler interface {
	AwaitSettled(ctx context.Context, id string, max time.Duration) (api.TaskInfoResponse, error)
}

// taskID is the path's task id, checked by the same rule as a submit: an
// id that could never have been submitted gets 400, not a lookup.
func taskID(c echo.Context) (string, error) {
	id := c.Param("id")
	if err := ident.TaskID(id); err != nil {
		return "", httpapi.Errorf(http.StatusBadRequest, "%v", err)
	}
	return id, nil
}

// MaxTerminateTimeout bounds a terminate's grace period (a week): larger
// values would overflow a time.Duration into an instant kill.
const MaxTerminateTimeout = 7 * 24 * 3600

func (s *srv) getTask(c echo.Context) error {
	id, err := taskID(c)
	if err != nil {
		return err
	}
	get := s.d.Tasks.Get
	if noCache(c.Request().Header) {
		get = s.d.Tasks.GetFresh
	}
	info, err := get(id)
	if err != nil {
		return toHTTP(err)
	}
	return httpapi.JSON(c, info)
}

// noCache says the request asks for a fresh answer (RFC 9111's no-cache
// request directive).
func noCache(h http.Header) bool {
	for _, v := range h.Values("Cache-Control") {
		for _, d := range strings.Split(v, ",") {
			if strings.EqualFold(strings.TrimSpace(d), "no-cache") {
				return true
			}
		}
	}
	return false
}

func (s *srv) terminate(c echo.Context) error {
	id, err := taskID(c)
	if err != nil {
		return err
	}
	var req api.TaskTerminateRequest
	if err := httpapi.Bind(c, &req); err != nil {
		return err
	}
	if req.TerminationReason != "" && !req.TerminationReason.Valid() {
		return httpapi.Errorf(http.StatusBadRequest, "unknown termination_reason %q", req.TerminationReason)
	}
	if req.Timeout > MaxTerminateTimeout {
		return httpapi.Errorf(http.StatusBadRequest, "timeout %d is out of range: 0..%d seconds", req.Timeout, MaxTerminateTimeout)
	}
	info, err := s.d.Tasks.Terminate(c.Request().Context(), id, req)
	if err != nil {
		return toHTTP(err)
	}
	return httpapi.JSON(c, info)
}

func (s *srv) remove(c echo.Context) error {
	id, err := taskID(c)
	if err != nil {
		return err
	}
	if err := s.d.Tasks.Remove(c.Request().Context(), id); err != nil {
		return toHTTP(err)
	}
	return httpapi.OK(c)
}

func (s *srv) metrics(c echo.Context) error {
	if s.d.GPUMetrics == nil {
		return httpapi.Errorf(http.StatusNotFound, "DCGM Exporter is not available")
	}
	id, err := taskID(c)
	if err != nil {
		return err
	}
	ids, err := s.d.Tasks.GPUIDs(id)
	if err != nil {
		return mapError(err, "Task not found")
	}
	text, ok, err := s.d.GPUMetrics.TaskMetrics(c.Request().Context(), ids)
	switch {
	case !ok:
		return httpapi.Errorf(http.StatusNotFound, "DCGM Exporter is not available")
	case err != nil:
		// The cause (an exporter's address, its answer) is logged, never sent.
		return &httpapi.Error{Status: http.StatusBadGateway, Message: "the GPU metrics source did not answer (the shim's log has the cause)", Err: err}
	}
	return c.Blob(http.StatusOK, "text/plain; charset=utf-8", []byte(text))
}
