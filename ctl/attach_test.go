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
		res, err := testClient(t, Config{Shim: shim, Progress: textTo(&status)}).Attach(ctx, "t1", time.Time{}, &out)
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
	res, err := testClient(t, Config{Shim: shim, Progress: textTo(&status)}).Attach(ctx, "t1", time.Time{}, &out)
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
	return oneTaskShim(t, runningTask(runnerURL, &job), kept, logAsked)
}

// runningTask is task t1 running on the host network with its runner's
// port at runnerURL's, and job as its job's last state (nil: none yet).
func runningTask(runnerURL string, job *api.JobStateEvent) api.TaskInfoResponse {
	_, port, _ := net.SplitHostPort(strings.TrimPrefix(runnerURL, "http://"))
	httpPort, _ := strconv.Atoi(port)
	return api.TaskInfoResponse{ID: "t1", Status: api.TaskRunning, Tandem: &api.TaskDetails{
		Name: "t1-name", NetworkMode: "host", RunnerHTTPPort: httpPort, Job: job,
	}}
}

// oneTaskShim plays a Tandem shim with one task, info (its id t1), whose
// kept output is kept (logAsked, when not nil, says whether it was asked
// for); it returns the shim's address.
func oneTaskShim(t *testing.T, info api.TaskInfoResponse, kept string, logAsked *atomic.Bool) string {
	t.Helper()
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

// A task terminated before its job said how it ended (the server stopped
// it; the shim keeps its output until it is removed): attach and logs -f
// print the kept output, and attach ends as tandem wait does (143, the
// shim's reason); logs --since says the kept output has no times.
func TestAttachAndLogsOfATerminatedTaskShowItsKeptOutput(t *testing.T) {
	info := runningTask("http://127.0.0.1:9", nil)
	info.Status, info.TerminationReason, info.TerminationMessage = api.TaskTerminated, api.ReasonTerminatedByServer, "stopped by the server"
	shim := oneTaskShim(t, info, "kept\n", nil)
	o := testClient(t, Config{Shim: shim})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var out syncBuffer
	res, err := o.Attach(ctx, "t1", time.Time{}, &out)
	if err != nil || out.String() != "kept\n" || res.ExitCode() != ExitStopped || res.Reason != api.ReasonTerminatedByServer {
		t.Errorf("attach: %v, output %q, exit %d, reason %q", err, out.String(), res.ExitCode(), res.Reason)
	}
	var logs syncBuffer
	if err := o.Logs(ctx, "t1", LogsOptions{Follow: true}, &logs); err != nil || logs.String() != "kept\n" {
		t.Errorf("logs -f: %v, output %q", err, logs.String())
	}
	var since syncBuffer
	err = o.Logs(ctx, "t1", LogsOptions{Since: time.Now().Add(-time.Minute)}, &since)
	if err == nil || !strings.Contains(err.Error(), "drop --since") || since.String() != "" {
		t.Errorf("logs --since: %v, output %q", err, since.String())
	}
}

// logs --since without -f reads a running task's output from its Tandem
// runner, asking for the output so far from that time (the runner closes
// the stream there); --tail applies to it. dstack's runner would follow:
// it is not asked, and the user is told to add -f.
func TestLogsSinceWithoutFollow(t *testing.T) {
	since := time.Date(2026, 11, 29, 7, 0, 0, 0, time.UTC)
	for _, tandem := range []bool{true, false} {
		var dialed atomic.Bool
		runner := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			switch r.URL.Path {
			case "/api/healthcheck":
				w.Header().Set("Content-Type", "application/json")
				if tandem {
					_, _ = w.Write([]byte(`{"service":"dstack-runner","version":"0.0.0","tandem_version":"0.1.0","tandem_task_id":"t1"}`))
				} else {
					_, _ = w.Write([]byte(`{"service":"dstack-runner","version":"0.0.0"}`))
				}
			case "/logs_ws":
				dialed.Store(true)
				q := r.URL.Query()
				if q.Get(api.LogsSoFarParam) != "1" || q.Get("start_time") != since.Format(time.RFC3339Nano) || q.Get(api.RunnerTaskParam) != "t1" {
					http.Error(w, "want the output so far since the time, for t1: "+r.URL.RawQuery, http.StatusBadRequest)
					return
				}
				conn, err := (&websocket.Upgrader{}).Upgrade(w, r, nil)
				if err != nil {
					return
				}
				_ = conn.WriteMessage(websocket.BinaryMessage, []byte("a\nb\n"))
				_ = conn.WriteMessage(websocket.BinaryMessage, []byte("c\n"))
				_ = conn.WriteControl(websocket.CloseMessage, []byte{}, time.Now().Add(time.Second))
				conn.Close()
			default:
				http.NotFound(w, r)
			}
		}))
		shim := oneTaskShim(t, runningTask(runner.URL, &api.JobStateEvent{State: api.JobRunning, Timestamp: 1}), "", nil)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		var all, tail syncBuffer
		errAll := testClient(t, Config{Shim: shim}).Logs(ctx, "t1", LogsOptions{Since: since}, &all)
		errTail := testClient(t, Config{Shim: shim}).Logs(ctx, "t1", LogsOptions{Since: since, Tail: 2, TailSet: true}, &tail)
		cancel()
		runner.Close()
		switch {
		case tandem && (errAll != nil || all.String() != "a\nb\nc\n" || errTail != nil || tail.String() != "b\nc\n"):
			t.Errorf("tandem runner: %v %q; tail 2: %v %q", errAll, all.String(), errTail, tail.String())
		case !tandem && (errAll == nil || !strings.Contains(errAll.Error(), "with -f") || dialed.Load() || all.String() != ""):
			t.Errorf("dstack's runner: %v, output %q, stream dialed %v", errAll, all.String(), dialed.Load())
		}
	}
}

func ptr[T any](v T) *T { return &v }
