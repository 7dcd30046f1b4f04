package ctl

import (
	"context"
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/tandem-run/tandem/api"
)

// An attach whose output stream is cut (a detached job's runner leaves at
// the job's end, and may leave with its stream partly sent) shows the
// rest of the output from what the shim kept, without showing twice what
// it already showed, and the job's exit: the job's whole output, once.
// A stream that ended with the runner's close had it all: the shim is not
// asked. Its state pulls are an onlooker's peeks (peek=1&logs=0).
func TestAttachShowsTheRestOfACutStreamFromTheShim(t *testing.T) {
	const whole = "out-a\nline-2\n"
	for _, sent := range []string{"", "out-", "out-a\n", whole + "(closed)"} {
		closed := strings.HasSuffix(sent, "(closed)")
		sent := strings.TrimSuffix(sent, "(closed)")
		var logAsked atomic.Bool
		runner := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			switch r.URL.Path {
			case "/api/healthcheck":
				w.Header().Set("Content-Type", "application/json")
				_, _ = w.Write([]byte(`{"service":"dstack-runner","version":"0.0.0"}`))
			case "/logs_ws":
				conn, err := (&websocket.Upgrader{}).Upgrade(w, r, nil)
				if err != nil {
					return
				}
				if sent != "" {
					_ = conn.WriteMessage(websocket.BinaryMessage, []byte(sent))
				}
				if closed {
					_ = conn.WriteControl(websocket.CloseMessage, []byte{}, time.Now().Add(time.Second))
					return
				}
				// The runner leaves: no close message.
				_ = conn.UnderlyingConn().Close()
			case "/api/pull":
				if q := r.URL.Query(); q.Get("peek") != "1" || q.Get("logs") != "0" {
					// attach is an onlooker: its pulls must not end a
					// job another driver collects.
					http.Error(w, "attach must peek at the states only", http.StatusBadRequest)
					return
				}
				w.Header().Set("Content-Type", "application/json")
				_, _ = w.Write([]byte(`{"job_states":[{"state":"failed","timestamp":2,"termination_reason":"container_exited_with_error","termination_message":"","exit_status":3}],"job_logs":[],"runner_logs":[],"last_updated":2,"has_more":false}`))
			default:
				http.NotFound(w, r)
			}
		}))
		defer runner.Close()
		shim := endedTaskShim(t, runner.URL, api.JobStateEvent{State: api.JobFailed, Timestamp: 2, TerminationReason: "container_exited_with_error", ExitStatus: ptr(3)},
			whole, &logAsked)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		var out, status syncBuffer
		res, err := Attach(ctx, "t1", TaskOptions{Shim: shim}, time.Time{}, &out, &status)
		cancel()
		if err != nil || res.ExitStatus == nil || *res.ExitStatus != 3 || out.String() != whole {
			t.Errorf("stream cut after %q (closed %v): %v, exit %v, output %q (status %q)", sent, closed, err, res.ExitStatus, out.String(), status.String())
		}
		if closed && logAsked.Load() {
			t.Errorf("a stream that ended with the runner's close: the shim's log was asked for too")
		}
	}
}

// The task's runner left and another task's runner now answers on its
// port (host network: a new task took the ports as the old one's
// container wound down). attach names its task on every call, that runner
// refuses (409), and attach prints what the shim kept for its own task,
// never the other task's output or exit. (An older runner that does not
// refuse is caught by its healthcheck's task id.)
func TestAttachNeverShowsAnotherTasksRunner(t *testing.T) {
	var unnamed atomic.Int32 // calls that did not name their task
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got := r.URL.Query().Get(api.RunnerTaskParam)
		if got == "" {
			unnamed.Add(1)
		}
		if got != "" && got != "t2" {
			http.Error(w, "this runner serves task t2, not "+got, http.StatusConflict)
			return
		}
		switch r.URL.Path {
		case "/api/healthcheck":
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"service":"dstack-runner","version":"0.0.0","tandem_task_id":"t2"}`))
		case "/logs_ws":
			conn, err := (&websocket.Upgrader{}).Upgrade(w, r, nil)
			if err == nil {
				_ = conn.WriteMessage(websocket.BinaryMessage, []byte("ANOTHER TENANT'S OUTPUT\n"))
				_ = conn.WriteControl(websocket.CloseMessage, []byte{}, time.Now().Add(time.Second))
				conn.Close()
			}
		case "/api/pull":
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"job_states":[{"state":"failed","timestamp":2,"termination_reason":"container_exited_with_error","termination_message":"","exit_status":99}],"job_logs":[],"runner_logs":[],"last_updated":2,"has_more":false}`))
		default:
			http.NotFound(w, r)
		}
	}))
	defer other.Close()
	shim := endedTaskShim(t, other.URL, api.JobStateEvent{State: api.JobDone, Timestamp: 2, TerminationReason: "done_by_runner", ExitStatus: ptr(0)},
		"my own output\n", nil)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var out, status syncBuffer
	res, err := Attach(ctx, "t1", TaskOptions{Shim: shim}, time.Time{}, &out, &status)
	if err != nil || res.ExitStatus == nil || *res.ExitStatus != 0 || out.String() != "my own output\n" {
		t.Fatalf("attach: %v, exit %v, output %q (status %q)", err, res.ExitStatus, out.String(), status.String())
	}
	if n := unnamed.Load(); n != 0 {
		t.Fatalf("%d calls to the runner did not name their task", n)
	}
}

// endedTaskShim plays a Tandem shim with one task, t1, still running on
// the host network with its runner's port at runnerURL's, whose job ended
// with job and whose kept output is kept (logAsked, when not nil, says
// whether it was asked for); it returns the shim's address.
func endedTaskShim(t *testing.T, runnerURL string, job api.JobStateEvent, kept string, logAsked *atomic.Bool) string {
	t.Helper()
	_, port, _ := net.SplitHostPort(strings.TrimPrefix(runnerURL, "http://"))
	httpPort, _ := strconv.Atoi(port)
	info := api.TaskInfoResponse{ID: "t1", Status: api.TaskRunning, Tandem: &api.TaskDetails{
		Name: "t1-name", NetworkMode: "host", RunnerHTTPPort: httpPort, Job: &job,
	}}
	shim := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/api/tasks/t1":
			w.Header().Set("Content-Type", "application/json")
			_ = json.NewEncoder(w).Encode(info)
		case "/api/tasks/t1/job-log":
			if logAsked != nil {
				logAsked.Store(true)
			}
			_, _ = w.Write([]byte(kept))
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(shim.Close)
	return strings.TrimPrefix(shim.URL, "http://")
}

func ptr[T any](v T) *T { return &v }
