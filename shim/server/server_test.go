package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/shim/component"
	"github.com/tandem-run/tandem/shim/gpu"
	"github.com/tandem-run/tandem/shim/runnerdir"
	"github.com/tandem-run/tandem/shim/task"
)

type staticComponent struct {
	info api.ComponentInfo
	err  error
}

func (s staticComponent) Info(context.Context) api.ComponentInfo { return s.info }
func (s staticComponent) StartInstall(context.Context, string, func(error)) error {
	return s.err
}

// stopFunc is a Stopper.
type stopFunc func(bool)

func (f stopFunc) Stop(force bool) {
	if f != nil {
		f(force)
	}
}

// newTestServer uses the real engine with a runtime that fails every Docker
// call: API behaviour does not depend on containers starting.
func newTestServer(t testing.TB, shutdown func(bool)) http.Handler {
	engine := task.New(task.Config{Home: t.TempDir(), RunnerHTTPPort: 10999, RunnerSSHPort: 10022, InfinibandPath: "/nonexistent"},
		deadRuntime{}, gpu.NewLocks(nil), nil, logging.Discard())
	t.Cleanup(func() { engine.Wait(); engine.Sync() }) // pipelines, then record writes, end before the temp dir goes
	return New(Deps{
		Version:        "0.21.2+tandem.test",
		TandemVersion:  "0.1.0",
		RunnerHTTPPort: 10999,
		Tasks:          engine,
		Runner:         staticComponent{info: api.ComponentInfo{Name: api.ComponentRunner, Status: api.ComponentInstalled, Version: "1"}},
		Shim:           staticComponent{info: api.ComponentInfo{Name: api.ComponentShim, Status: api.ComponentInstalling}, err: component.ErrInstalling},
		Stopper:        stopFunc(shutdown),
		Log:            logging.Discard(),
	})
}

func do(h http.Handler, method, path, body string) (int, string) {
	req := httptest.NewRequest(method, path, strings.NewReader(body))
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	b, _ := io.ReadAll(rec.Body)
	return rec.Code, string(b)
}

func TestComponentsAndShutdown(t *testing.T) {
	shut := make(chan bool, 1)
	h := newTestServer(t, func(force bool) { shut <- force })
	tests := []struct {
		method, path, body string
		code               int
		want               string
	}{
		// A Tandem shim's hello says where host-network runners answer.
		{"GET", "/api/healthcheck", "", 200, `{"service":"dstack-shim","version":"0.21.2+tandem.test","tandem_version":"0.1.0","tandem_runner_http_port":10999}` + "\n"},
		{"GET", "/api/components", "", 200, `{"components":[{"name":"dstack-runner","version":"1","status":"installed"},{"name":"dstack-shim","version":"","status":"installing"}]}` + "\n"},
		{"POST", "/api/components/install", `{"url":"http://x"}`, 400, "empty name\n"},
		{"POST", "/api/components/install", `{"name":"dstack-gateway","url":"http://x"}`, 400, "unknown component\n"},
		{"POST", "/api/components/install", `{"name":"dstack-runner"}`, 400, "empty url\n"},
		{"POST", "/api/components/install", `{"name":"dstack-shim","url":"http://x"}`, 409, "already installing\n"},
		{"POST", "/api/components/install", `{"name":"dstack-runner","url":"http://x"}`, 200, "\n"},
		{"GET", "/api/instance/health", "", 200, `{"dcgm":null}` + "\n"},
		{"GET", "/api/instance/info", "", 200, "{}\n"},
		{"GET", "/metrics/tasks/x", "", 404, "DCGM Exporter is not available\n"},
		{"GET", "/api/tasks", "", 200, `{"tasks":[]}` + "\n"},
		{"POST", "/api/tasks/x/remove", "", 404, "Not Found\n"},
		{"POST", "/api/shutdown", "", 400, "Request body must not be empty\n"},
		{"POST", "/api/shutdown", `{}`, 200, "\n"},
	}
	for _, tc := range tests {
		code, body := do(h, tc.method, tc.path, tc.body)
		if code != tc.code || body != tc.want {
			t.Errorf("%s %s %s: got %d %q, want %d %q", tc.method, tc.path, tc.body, code, body, tc.code, tc.want)
		}
	}
	if force := <-shut; force {
		t.Fatal("{} means force=false")
	}
}

func FuzzShimRequests(f *testing.F) {
	f.Add(0, `{"id":"a","name":"b","image_name":"c","gpu":1,"volumes":[{"backend":"aws"}]}`)
	f.Add(1, `{"termination_reason":"terminated_by_user","timeout":3}`)
	f.Add(2, `{"name":"dstack-runner","url":"http://x"}`)
	f.Add(0, `{"id":"a","name":"b","image_name":"c","cpu":-1}`)
	f.Add(0, `{"id":"a/../b","name":"x y","image_name":"::"}`)
	f.Add(0, `{"id":"a","name":"b","image_name":"c","network_mode":"bridge","tandem_publish":[{"host_ip":"::1","host_port":-1,"container_port":70000,"protocol":"sctp"}]}`)
	h := newTestServer(f, func(bool) {})
	paths := []string{"/api/tasks", "/api/tasks/a/terminate", "/api/components/install"}
	f.Fuzz(func(t *testing.T, which int, body string) {
		path := paths[((which%len(paths))+len(paths))%len(paths)]
		code, msg := do(h, "POST", path, body)
		if code >= 500 {
			t.Fatalf("POST %s %q: %d %q", path, body, code, msg)
		}
	})
}

// errTasks answers every call with its error.
type errTasks struct{ err error }

func (e errTasks) Submit(api.TaskConfig) (api.TaskInfoResponse, error) {
	return api.TaskInfoResponse{}, e.err
}
func (e errTasks) Get(string) (api.TaskInfoResponse, error) { return api.TaskInfoResponse{}, e.err }
func (e errTasks) GetFresh(string) (api.TaskInfoResponse, error) {
	return api.TaskInfoResponse{}, e.err
}
func (e errTasks) List() []api.TaskListItem { return nil }
func (e errTasks) Terminate(context.Context, string, api.TaskTerminateRequest) (api.TaskInfoResponse, error) {
	return api.TaskInfoResponse{}, e.err
}
func (e errTasks) Remove(context.Context, string) error { return e.err }
func (e errTasks) JobLog(string) (io.ReadCloser, error) { return nil, e.err }
func (e errTasks) GPUIDs(string) ([]string, error)      { return nil, e.err }
func (e errTasks) ImageConfig(context.Context, string) (api.TaskImageConfig, error) {
	return api.TaskImageConfig{}, e.err
}

// What a client reads is chosen by the shim, never an internal error's
// text: no host path, no Go or Docker wording; the log has the cause.
func TestInternalErrorsAreNotSent(t *testing.T) {
	const cause = "open /root/.dstack/tasks/x.json: input/output error"
	cases := []struct {
		err  error
		code int
		want string
	}{
		{fmt.Errorf("%w: task record x: %s", task.ErrStorage, cause), 507, "the shim cannot save the task's record; free space in its home\n"},
		{&task.StopError{Err: errors.New("Error response from daemon: cannot stop container: /var/lib/docker/containers/abc: permission denied")}, 500,
			"internal error: failed to stop the task's container (the agent's log has the cause)\n"},
		{errors.New(cause), 500, "internal error: the request failed (the agent's log has the cause)\n"},
	}
	for _, c := range cases {
		var log strings.Builder
		h := New(Deps{Version: "test", Tasks: errTasks{c.err}, Log: slog.New(slog.NewTextHandler(&log, nil))})
		for _, r := range [][3]string{
			{"POST", "/api/tasks", `{"id":"x","name":"x","image_name":"busybox"}`},
			{"GET", "/api/tasks/x", ""},
			{"POST", "/api/tasks/x/terminate", `{}`},
			{"POST", "/api/tasks/x/remove", ""},
			{"GET", "/api/tasks/x/job-log", ""},
			{"GET", "/api/tasks/x/image-config", ""},
		} {
			code, body := do(h, r[0], r[1], r[2])
			if code != c.code || body != c.want {
				t.Errorf("%s %s with %v: %d %q, want %d %q", r[0], r[1], c.err, code, body, c.code, c.want)
			}
			for _, leak := range []string{"/root", "/var/lib", "input/output", "daemon", "permission denied"} {
				if strings.Contains(body, leak) {
					t.Errorf("%s %s: the body carries %q: %q", r[0], r[1], leak, body)
				}
			}
		}
		if !strings.Contains(log.String(), "/root/.dstack/tasks/x.json") && !strings.Contains(log.String(), "/var/lib/docker") {
			t.Errorf("the cause is not in the log: %s", log.String())
		}
	}
}

// A submit the runner dirs' room does not fit is a 507 whose text says
// what the home has and the rule (runnerdir.NoRoomError), as the engine
// returned it.
func TestNoRoomForARunnerDirIs507(t *testing.T) {
	err := fmt.Errorf("reserve: %w", &runnerdir.NoRoomError{Free: 100 << 20, Floor: 64 << 20, Claimed: 20 << 20, Min: 16 << 20})
	h := New(Deps{Version: "test", Tasks: errTasks{err}, Log: slog.New(slog.DiscardHandler)})
	code, body := do(h, "POST", "/api/tasks", `{"id":"x","name":"x","image_name":"busybox"}`)
	const want = "no room on the shim home's disk for another runner dir: it has 100 MiB free, keeps 64 MiB free (its floor), and the runner dirs already made may still grow by 20 MiB; a runner dir needs at least 16 MiB: free space in its home or remove ended tasks\n"
	if code != http.StatusInsufficientStorage || body != want {
		t.Fatalf("%d %q", code, body)
	}
}

func TestNoCacheDirective(t *testing.T) {
	for v, want := range map[string]bool{"no-cache": true, "max-age=0, No-Cache": true, "no-store": false, "": false, "no-cache-please": false} {
		h := http.Header{}
		if v != "" {
			h.Set("Cache-Control", v)
		}
		if got := noCache(h); got != want {
			t.Errorf("%q: %v, want %v", v, got, want)
		}
	}
}

// metricsSource is a GPUMetrics answering err, or text when err is nil.
type metricsSource struct{ err error }

func (m metricsSource) TaskMetrics(context.Context, []string) (string, bool, error) {
	return "DCGM_FI_DEV_GPU_UTIL 1\n", true, m.err
}

// /metrics/tasks words an unknown task as dstack's shim does ("Task not
// found", where the task routes say "Not Found"), and a failed source's
// cause is logged, never sent.
func TestTaskMetricsAnswers(t *testing.T) {
	const cause = "Get \"http://127.0.0.1:9400/metrics\": dial tcp 127.0.0.1:9400: connect: connection refused"
	engine := task.New(task.Config{Home: t.TempDir(), InfinibandPath: "/nonexistent"}, deadRuntime{}, gpu.NewLocks(nil), nil, logging.Discard())
	t.Cleanup(func() { engine.Wait(); engine.Sync() })
	for _, c := range []struct {
		name  string
		tasks Tasks
		src   metricsSource
		code  int
		want  string
	}{
		{"unknown task", engine, metricsSource{}, 404, "Task not found\n"},
		{"source failed", errTasks{}, metricsSource{err: errors.New(cause)}, 502, "the GPU metrics source did not answer (the shim's log has the cause)\n"},
		{"answered", errTasks{}, metricsSource{}, 200, "DCGM_FI_DEV_GPU_UTIL 1\n"},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := New(Deps{Version: "0.21.2+tandem.test", Tasks: c.tasks, GPUMetrics: c.src, Log: logging.Discard()})
			code, body := do(h, "GET", "/metrics/tasks/x", "")
			if code != c.code || body != c.want {
				t.Fatalf("got %d %q, want %d %q", code, body, c.code, c.want)
			}
		})
	}
}
