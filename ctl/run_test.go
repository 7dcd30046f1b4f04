package ctl

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/runnerclient"
	"github.com/tandem-run/tandem/api/shimclient"
	"slices"
)

func TestResultExitCodeAndDescribe(t *testing.T) {
	seven := 7
	oom := 137
	tests := []struct {
		r    Result
		code int
		desc string
	}{
		{Result{State: api.JobDone}, 0, "job done"},
		{Result{State: api.JobFailed, ExitStatus: &seven}, 7, "job failed: exit status 7"},
		{Result{State: api.JobFailed, ExitStatus: &oom, Message: "out of memory: the kernel killed the job"}, 137,
			"job failed: exit status 137: out of memory: the kernel killed the job"},
		{Result{State: api.JobTerminated, Reason: api.ReasonMaxDurationExceeded, Message: "Max duration exceeded"}, ExitMaxDuration,
			"job terminated: max_duration_exceeded: Max duration exceeded"},
		{Result{State: api.JobTerminated, Interrupted: true}, ExitInterrupted, "job terminated"},
		{Result{State: api.JobTerminated, Reason: api.ReasonTerminatedByUser}, ExitStopped, "job terminated: terminated_by_user"},
		{Result{State: api.JobFailed, Reason: api.ReasonExecutorError}, ExitFailure, "job failed: executor_error"},
	}
	for _, tc := range tests {
		if got := tc.r.ExitCode(); got != tc.code {
			t.Errorf("%+v: code %d want %d", tc.r, got, tc.code)
		}
		if got := Describe(tc.r); got != tc.desc {
			t.Errorf("%+v: %q want %q", tc.r, got, tc.desc)
		}
	}
	if id := newID(); len(id) != 36 || id[14] != '4' {
		t.Errorf("task ids are UUIDv4: %q", id)
	}
}

// TestPrepareJobConflictOnHostNetwork: a runner that already has a job
// answers 409; on the host network that means another task holds the
// runner's ports: the error hints at bridge networking and stays an
// api.ErrConflict.
func TestPrepareJobConflictOnHostNetwork(t *testing.T) {
	r := testRunner(t, func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "job already submitted", http.StatusConflict)
	})
	for _, network := range []string{"host", "bridge"} {
		err := prepareJob(context.Background(), r, RunOptions{Network: network}, api.SubmitBody{})
		if !errors.Is(err, api.ErrConflict) {
			t.Fatalf("%s: %v is not a conflict", network, err)
		}
		if hinted := HintOf(err) == HintBridgeNetwork; hinted != (network == "host") {
			t.Errorf("%s: %v has hint %v", network, err, HintOf(err))
		}
	}
}

// A runner that went away while the shim still says its task runs (the
// container's stop is under way) is explained by the shim's word once it
// comes: here the task is removed after three more looks.
func TestFollowAwaitsTheShimsWordWhenTheRunnerIsGone(t *testing.T) {
	var gets atomic.Int32
	shimSrv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if gets.Add(1) <= 3 {
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"id":"t1","status":"running"}`))
			return
		}
		http.Error(w, `{"detail":{"code":"not_found","msg":"no such task"}}`, http.StatusNotFound)
	}))
	defer shimSrv.Close()
	gone := httptest.NewServer(http.NotFoundHandler())
	gone.Close() // the runner's port: connection refused
	o := RunOptions{Commands: []string{"true"}, Out: io.Discard}
	r, err := NewRun(testClient(t, Config{Shim: shimSrv.URL}), o)
	if err != nil {
		t.Fatal(err)
	}
	r.id = "t1"
	if r.runner, err = runnerclient.New(strings.TrimPrefix(gone.URL, "http://")); err != nil {
		t.Fatal(err)
	}
	_, _, err = r.Follow(context.Background())
	if err == nil || !strings.Contains(err.Error(), "removed by someone else") || gets.Load() < 4 {
		t.Fatalf("after %d shim looks: %v", gets.Load(), err)
	}
}

// A runner that could not bind its ports on the host network is explained
// by who holds them, as the shim's task list tells: another running
// host-network task (named; bridge and ended tasks do not count), no task
// (another process: its own hint), or, when the list cannot be read, the
// old guess. In bridge networking nothing is added.
func TestTaskEndedSaysWhoHoldsTheRunnersPorts(t *testing.T) {
	ended := api.TaskInfoResponse{ID: "self", Status: api.TaskTerminated, TerminationReason: api.ReasonContainerExitedWithError,
		TerminationMessage: "dstack-runner: api: listen tcp 127.0.0.1:10999: bind: address already in use"}
	shimWith := func(tasks ...string) *shimclient.Client {
		return testShim(t, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			switch r.URL.Path {
			case "/api/tasks":
				_, _ = w.Write([]byte(`{"tasks":[{"id":"self","status":"terminated"},{"id":"b1","status":"running"},{"id":"h0","status":"terminated"},{"id":"h1","status":"running"}]}`))
			case "/api/tasks/self":
				_, _ = w.Write([]byte(`{"id":"self","status":"terminated","tandem":{"name":"me","network_mode":"host"}}`))
			case "/api/tasks/b1":
				_, _ = w.Write([]byte(`{"id":"b1","status":"running","tandem":{"name":"web","network_mode":"bridge"}}`))
			case "/api/tasks/h0":
				_, _ = w.Write([]byte(`{"id":"h0","status":"terminated","tandem":{"name":"old","network_mode":"host"}}`))
			case "/api/tasks/h1":
				if !slices.Contains(tasks, "h1") {
					http.NotFound(w, r) // removed since the list
					return
				}
				_, _ = w.Write([]byte(`{"id":"h1","status":"running","tandem":{"name":"train","network_mode":"host"}}`))
			default:
				http.Error(w, "broken", http.StatusBadRequest)
			}
		})
	}
	ctx := context.Background()
	err := onShim(shimWith("h1"), nil).taskEnded(ctx, ended, "host")
	if HintOf(err) != HintBridgeNetwork || !strings.Contains(err.Error(), "task train runs on the host network") {
		t.Errorf("another host task: %v (hint %v)", err, HintOf(err))
	}
	err = onShim(shimWith(), nil).taskEnded(ctx, ended, "host")
	if HintOf(err) != HintPortsTaken || !strings.Contains(err.Error(), "another process on this host") {
		t.Errorf("no task: %v (hint %v)", err, HintOf(err))
	}
	dead, _ := shimclient.New("127.0.0.1:1")
	err = onShim(dead, nil).taskEnded(ctx, ended, "host")
	if HintOf(err) != HintBridgeNetwork || !strings.Contains(err.Error(), "may hold") {
		t.Errorf("unreadable list: %v (hint %v)", err, HintOf(err))
	}
	var te *TaskEndedError
	if !errors.As(err, &te) {
		t.Errorf("not a TaskEndedError: %v", err)
	}
	if err := onShim(shimWith("h1"), nil).taskEnded(ctx, ended, "bridge"); HintOf(err) != HintNone || strings.Contains(err.Error(), "\n") {
		t.Errorf("bridge: %v", err)
	}
}

// A host-network run is refused before anything is made while another
// task of the shim runs on the host network with its job not ended: its
// runner holds the ports the new one needs. A task whose job ended (its
// runner is leaving), a bridge task, a terminated one do not count, nor
// does anything for a bridge run; a shim that does not say a task's
// network (dstack's) runs it on the host's. A name in use is refused
// first, as before. A holder is looked at again for a second first: a
// short job run -d just before ends in that time, and is no obstacle.
func TestRunRefusesAHostRunWhileAnotherHoldsThePorts(t *testing.T) {
	var mu sync.Mutex
	serve := func(tasks map[string]string) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			defer mu.Unlock()
			w.Header().Set("Content-Type", "application/json")
			if r.URL.Path == "/api/tasks" {
				var ids []string
				for id := range tasks {
					ids = append(ids, `{"id":"`+id+`","status":"running"}`)
				}
				_, _ = w.Write([]byte(`{"tasks":[` + strings.Join(ids, ",") + `]}`))
				return
			}
			body, ok := tasks[strings.TrimPrefix(r.URL.Path, "/api/tasks/")]
			if !ok {
				http.NotFound(w, r)
				return
			}
			_, _ = w.Write([]byte(body))
		}
	}
	shimWith := func(tasks map[string]string) *shimclient.Client { return testShim(t, serve(tasks)) }
	ctx := context.Background()
	harmless := map[string]string{
		"b1": `{"id":"b1","status":"running","tandem":{"name":"web","network_mode":"bridge"}}`,
		"h0": `{"id":"h0","status":"terminated","tandem":{"name":"old","network_mode":"host"}}`,
		"h2": `{"id":"h2","status":"running","tandem":{"name":"ended","network_mode":"host","job":{"state":"done","timestamp":5,"termination_reason":"done_by_runner","termination_message":""}}}`,
	}
	clk := &fakeClock{now: time.Unix(1000, 0)}
	if err := onShim(shimWith(harmless), clk).checkShimRoom(ctx, "", "host"); err != nil || clk.waits != 0 {
		t.Fatalf("no holder: %v (%d waits)", err, clk.waits)
	}
	for name, holder := range map[string]string{
		"train": `{"id":"h1","status":"running","tandem":{"name":"train","network_mode":"host"}}`,
		"boot":  `{"id":"h1","status":"creating","tandem":{"name":"boot","network_mode":"host"}}`,
		"h1":    `{"id":"h1","status":"running"}`, // dstack's shim: no details
	} {
		tasks := maps.Clone(harmless)
		tasks["h1"] = holder
		clk := &fakeClock{now: time.Unix(1000, 0)}
		err := onShim(shimWith(tasks), clk).checkShimRoom(ctx, "", "host")
		if !errors.Is(err, ErrPortsHeld) || HintOf(err) != HintBridgeNetwork || !strings.Contains(err.Error(), "task "+name+" runs on the host network") {
			t.Errorf("holder %s: %v (hint %v)", name, err, HintOf(err))
		}
		if waited := clk.Now().Sub(time.Unix(1000, 0)); waited < holderGrace || waited > holderGrace+time.Second {
			t.Errorf("holder %s refused after %v, not after about %v", name, waited, holderGrace)
		}
		if err := onShim(shimWith(tasks), nil).checkShimRoom(ctx, "", "bridge"); err != nil {
			t.Errorf("bridge run beside %s: %v", name, err)
		}
		if err := onShim(shimWith(tasks), nil).checkShimRoom(ctx, "web", "bridge"); !errors.Is(err, ErrNameInUse) {
			t.Errorf("name in use beside %s: %v", name, err)
		}
	}

	// A holder whose job ends on the third look, or that is removed, is
	// waited for.
	for what, ended := range map[string]string{
		"job ended":  `{"id":"h1","status":"running","tandem":{"name":"quick","network_mode":"host","job":{"state":"done","timestamp":5,"termination_reason":"done_by_runner","termination_message":""}}}`,
		"terminated": `{"id":"h1","status":"terminated","tandem":{"name":"quick","network_mode":"host"}}`,
		"removed":    "",
	} {
		tasks := maps.Clone(harmless)
		tasks["h1"] = `{"id":"h1","status":"running","tandem":{"name":"quick","network_mode":"host"}}`
		looks := 0
		h := serve(tasks)
		clk := &fakeClock{now: time.Unix(1000, 0)}
		hooked := testShim(t, func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/api/tasks/h1" {
				mu.Lock()
				if looks++; looks == 3 {
					if ended == "" {
						delete(tasks, "h1")
					} else {
						tasks["h1"] = ended
					}
				}
				mu.Unlock()
			}
			h(w, r)
		})
		if err := onShim(hooked, clk).checkShimRoom(ctx, "", "host"); err != nil {
			t.Errorf("a holder whose %s: %v", what, err)
		}
		if clk.waits < 1 || clk.Now().Sub(time.Unix(1000, 0)) >= holderGrace {
			t.Errorf("a holder whose %s: %d waits, %v", what, clk.waits, clk.Now().Sub(time.Unix(1000, 0)))
		}
	}
}

// A job whose submit the runner would refuse as too large (413 once its
// task runs) is refused before anything is made, with its largest parts
// named; one just under the bound passes.
func TestRunRefusesAJobTooLargeToSubmit(t *testing.T) {
	big := strings.Repeat("a", 120_000)
	env := map[string]string{}
	for i := range 9 {
		env[fmt.Sprintf("B%d", i)] = big
	}
	env["SMALL"] = "1"
	o := RunOptions{Commands: []string{"true"}, Env: env}
	local := testClient(t, Config{Shim: "127.0.0.1:1"})
	_, err := NewRun(local, o)
	if err == nil || !strings.Contains(err.Error(), "takes at most 1MiB") || !strings.Contains(err.Error(), "env B") || strings.Contains(err.Error(), "SMALL") {
		t.Fatalf("too large: %v", err)
	}
	if _, err := NewCluster(local, o, []Node{{Shim: "127.0.0.1:1"}, {Shim: "127.0.0.1:2"}}); err == nil || !strings.Contains(err.Error(), "takes at most 1MiB") {
		t.Fatalf("too large, multi-node: %v", err)
	}
	delete(env, "B0")
	if _, err := NewRun(local, o); err != nil {
		t.Fatalf("under the bound: %v", err)
	}
}

// testRunner is a client of a runner that h plays, closed with the test.
func testRunner(t *testing.T, h http.HandlerFunc) *runnerclient.Client {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	r, err := runnerclient.New(strings.TrimPrefix(srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// testClient is the client cfg makes.
func testClient(t *testing.T, cfg Config) *Client {
	t.Helper()
	c, err := NewClient(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// onShim is a client whose shim connection is shim, its clock clk.
func onShim(shim *shimclient.Client, clk Clock) *Client {
	return &Client{clk: clockOr(clk), shim: shim}
}

// textTo is a Progress that writes each event's text to w, a line each.
func textTo(w io.Writer) func(Event) {
	return func(e Event) { fmt.Fprintln(w, e.Text) }
}

// testShim is a client of a shim played by h, closed with the test.
func testShim(t *testing.T, h http.HandlerFunc) *shimclient.Client {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	c, err := shimclient.New(strings.TrimPrefix(srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// A run's cleanup on a Tandem shim sends the remove right behind the
// terminate. A shim that serves a task's calls one at a time (ours)
// removes the task once the stop ended: one remove. One that refuses a
// remove while the task still runs (the remove got there first) is asked
// again once the terminate answered. Either way the task is gone and
// nothing fails. dstack's shim exits when a task's terminate and remove
// overlap: without behind, the remove never comes during the terminate.
func TestCleanupRemovesRightBehindTheTerminate(t *testing.T) {
	for _, serial := range []bool{true, false} {
		var mu sync.Mutex
		var calls []string
		terminated := make(chan struct{})
		var once sync.Once
		shim := testShim(t, func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			calls = append(calls, strings.TrimPrefix(r.URL.Path, "/api/tasks/t1/"))
			mu.Unlock()
			switch r.URL.Path {
			case "/api/tasks/t1/terminate":
				time.Sleep(50 * time.Millisecond) // Docker's stop
				once.Do(func() { close(terminated) })
				w.Header().Set("Content-Type", "application/json")
				_, _ = w.Write([]byte(`{"id":"t1","status":"terminated"}`))
			case "/api/tasks/t1/remove":
				if serial {
					<-terminated // the task's lock: after the stop
				} else {
					select {
					case <-terminated:
					default:
						http.Error(w, `{"detail":{"code":"conflict","msg":"cannot remove task t1 with running status"}}`, http.StatusConflict)
						return
					}
				}
				w.WriteHeader(http.StatusOK)
			default:
				http.NotFound(w, r)
			}
		})
		if err := onShim(shim, nil).cleanup(context.Background(), "t1", 5, true); err != nil {
			t.Fatalf("serial %v: %v", serial, err)
		}
		// Which handler a busy machine enters first is the scheduler's
		// call, not the order the calls were sent in: compared unordered.
		want := []string{"remove", "terminate"}
		if !serial {
			want = []string{"remove", "remove", "terminate"}
		}
		mu.Lock()
		got := slices.Sorted(slices.Values(calls))
		mu.Unlock()
		if !slices.Equal(got, want) {
			t.Errorf("serial %v: calls %v, want %v", serial, got, want)
		}
	}
}

func TestCleanupNeverOverlapsOnDstacksShim(t *testing.T) {
	var busy, overlapped atomic.Bool
	var removes atomic.Int32
	shim := testShim(t, func(w http.ResponseWriter, r *http.Request) {
		if !busy.CompareAndSwap(false, true) {
			overlapped.Store(true) // dstack's shim: log.Fatal("already locked!")
			http.Error(w, "shim gone", http.StatusInternalServerError)
			return
		}
		defer busy.Store(false)
		switch r.URL.Path {
		case "/api/tasks/t1/terminate":
			time.Sleep(50 * time.Millisecond)
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"id":"t1","status":"terminated"}`))
		case "/api/tasks/t1/remove":
			removes.Add(1)
			w.WriteHeader(http.StatusOK)
		default:
			http.NotFound(w, r)
		}
	})
	if err := onShim(shim, nil).cleanup(context.Background(), "t1", 5, false); err != nil || overlapped.Load() || removes.Load() != 1 {
		t.Fatalf("cleanup: %v; overlapped %v; %d removes", err, overlapped.Load(), removes.Load())
	}
}

// tandem wait on a task someone stopped, seen terminated before it was
// removed (its job never said how it ended), exits as for a removed one:
// 143; a task that failed before its job ran stays a failure (125).
func TestWaitOnAStoppedTaskIs143(t *testing.T) {
	for reason, want := range map[string]int{"terminated_by_user": ExitStopped, "terminated_by_server": ExitStopped, "creating_container_error": ExitFailure} {
		shim := testShim(t, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"id":"t1","status":"terminated","termination_reason":"` + reason + `","termination_message":""}`))
		})
		res, err := testClient(t, Config{Shim: strings.TrimPrefix(shim.BaseURL(), "http://")}).Wait(context.Background(), "t1")
		if err != nil || res.ExitCode() != want {
			t.Errorf("%s: exit %d (%v), want %d", reason, res.ExitCode(), err, want)
		}
	}
}

// A run with no code to upload submits and starts its job in one call
// when the runner can (Tandem's: one round trip less over a long link),
// and falls back to /api/run when it answers the submit as dstack's
// runner does; a run with code submits, uploads and runs. Each tells
// where and as whom the job runs. Every submit asks for a stdin that ends
// at once (api.StdinNone), as docker run gives one without -i.
func TestStartJobSubmitsAndRunsInOneCallWhenTheRunnerCan(t *testing.T) {
	for _, tc := range []struct {
		name   string
		tandem bool
		code   bool
		want   string
	}{
		{"tandem runner", true, false, "POST /api/submit run"},
		{"dstack runner", false, false, "POST /api/submit run, POST /api/run"},
		{"tandem runner with code", true, true, "POST /api/submit, POST /api/upload_code, POST /api/run"},
	} {
		var mu sync.Mutex
		var calls []string
		runner := testRunner(t, func(w http.ResponseWriter, req *http.Request) {
			call := req.Method + " " + req.URL.Path
			if req.URL.Path == "/logs_ws" {
				http.NotFound(w, req)
				return
			}
			switch req.URL.Path {
			case "/api/submit":
				var body api.SubmitBody
				if err := json.NewDecoder(req.Body).Decode(&body); err != nil {
					http.Error(w, err.Error(), http.StatusBadRequest)
					return
				}
				if body.Tandem == nil || body.Tandem.Stdin != api.StdinNone {
					t.Errorf("the submit's extras are %+v; want stdin %q (a job's stdin ends at once, as docker run's)", body.Tandem, api.StdinNone)
				}
				if body.Tandem != nil && body.Tandem.Run {
					call += " run"
					if tc.tandem {
						w.Header().Set("Content-Type", "application/json")
						_, _ = w.Write([]byte(`{"started":true,"working_dir":"/workflow","username":"root"}`))
						break
					}
				}
				w.WriteHeader(http.StatusOK)
			case "/api/upload_code":
				_, _ = io.Copy(io.Discard, req.Body)
				w.WriteHeader(http.StatusOK)
			case "/api/run":
				w.Header().Set("Content-Type", "application/json")
				_, _ = w.Write([]byte(`{"working_dir":"/workflow","username":"root"}`))
			default:
				http.NotFound(w, req)
			}
			mu.Lock()
			calls = append(calls, call)
			mu.Unlock()
		})
		var said []string
		o := RunOptions{Commands: []string{"true"}, Out: io.Discard}
		cfg := Config{Shim: "127.0.0.1:1", Progress: func(e Event) { said = append(said, e.Text) }}
		if tc.code {
			o.CodeDir = t.TempDir()
		}
		if err := runWithRunner(t, cfg, o, runner).StartJob(context.Background()); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		mu.Lock()
		got := strings.Join(calls, ", ")
		mu.Unlock()
		if got != tc.want {
			t.Errorf("%s: calls %q, want %q", tc.name, got, tc.want)
		}
		if !slices.Contains(said, "job running in /workflow as root") {
			t.Errorf("%s: said %q", tc.name, said)
		}
	}
}

// runWithRunner is a run of o, on the client cfg makes, whose runner is
// runner, found ready.
func runWithRunner(t *testing.T, cfg Config, o RunOptions, runner *runnerclient.Client) *Run {
	t.Helper()
	r, err := NewRun(testClient(t, cfg), o)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	close(done)
	r.probe = &runnerProbe{done: done, cancel: func() {}, r: runner}
	return r
}

// TestInteractiveNeedsTandemsRunner: --interactive is refused, before the
// job is submitted, by a runner without a stdin stream (dstack's: its job
// would read a terminal nobody types into); with Tandem's the submit asks
// for the stream (api.StdinStream). With --detach it is refused at once.
func TestInteractiveNeedsTandemsRunner(t *testing.T) {
	for _, tandem := range []bool{false, true} {
		var mu sync.Mutex
		var modes []string
		runner := testRunner(t, func(w http.ResponseWriter, req *http.Request) {
			switch req.URL.Path {
			case "/api/healthcheck":
				hc := api.HealthcheckResponse{Service: api.ServiceRunner, Version: "0.19.40"}
				if tandem {
					hc.TandemVersion = "0.1.0"
				}
				w.Header().Set("Content-Type", "application/json")
				_ = json.NewEncoder(w).Encode(hc)
			case "/api/submit":
				var body api.SubmitBody
				_ = json.NewDecoder(req.Body).Decode(&body)
				mu.Lock()
				modes = append(modes, body.Tandem.Stdin)
				mu.Unlock()
				w.Header().Set("Content-Type", "application/json")
				_, _ = w.Write([]byte(`{"started":true,"working_dir":"/workflow","username":"root"}`))
			default:
				http.NotFound(w, req)
			}
		})
		o := RunOptions{Commands: []string{"cat"}, Out: io.Discard, Stdin: strings.NewReader("input")}
		ctx, cancel := context.WithCancel(context.Background())
		err := runWithRunner(t, Config{Shim: "127.0.0.1:1"}, o, runner).StartJob(ctx)
		cancel()
		mu.Lock()
		got := slices.Clone(modes)
		mu.Unlock()
		if !tandem {
			if err == nil || !strings.Contains(err.Error(), "takes no input") || len(got) != 0 {
				t.Fatalf("dstack's runner: %v, submits %q; want a refusal before any submit", err, got)
			}
			continue
		}
		if err != nil || !slices.Equal(got, []string{api.StdinStream}) {
			t.Fatalf("Tandem's runner: %v, submits with stdin %q; want one with %q", err, got, api.StdinStream)
		}
	}
	if _, err := NewRun(testClient(t, Config{Shim: "127.0.0.1:1"}), RunOptions{Commands: []string{"cat"}, Stdin: strings.NewReader(""), Detach: true}); err == nil {
		t.Fatal("--interactive with --detach was not refused")
	}
}

// TestRemoteCommand: words are quoted for the remote shell so the program
// gets them as they are; one word alone is a shell line unless argv is
// asked for (exec).
func TestRemoteCommand(t *testing.T) {
	for _, c := range []struct {
		words     []string
		shellLine bool
		want      []string
	}{
		{nil, true, nil},
		{[]string{"--"}, true, nil},
		{[]string{"--", "sh", "-c", "exit 5"}, true, []string{"sh -c 'exit 5'"}},
		{[]string{"make && make test"}, true, []string{"make && make test"}},
		{[]string{"make && make test"}, false, []string{"'make && make test'"}},
		{[]string{"echo", "it's", "$HOME"}, false, []string{`echo 'it'\''s' '$HOME'`}},
		{[]string{"printf", ""}, false, []string{"printf ''"}},
	} {
		if got := RemoteCommand(c.words, c.shellLine); !slices.Equal(got, c.want) {
			t.Errorf("RemoteCommand(%q, %v) = %q, want %q", c.words, c.shellLine, got, c.want)
		}
	}
}

// A run takes the submit's answer as its first look at the task: a
// Tandem shim answers once the task runs, its ports known, and the run
// asks no more (over a long link a look is a round trip). dstack's shim
// answers at once with the task pending, in its own field names: the run
// then looks until it runs. An answer that is no task is no look.
func TestWaitTaskTakesTheSubmitsAnswer(t *testing.T) {
	for _, tc := range []struct {
		name, answer string
		wantGets     int
	}{
		{"tandem, running", `{"ID":"%s","Status":"running","Ports":[],"tandem":{"name":"n","network_mode":"host","runner_http_port":10999}}`, 0},
		{"dstack, pending", `{"ID":"%s","Status":"pending","Ports":null}`, 1},
		{"no task", `{}`, 1},
		{"not json", `ok`, 1},
	} {
		var mu sync.Mutex
		gets := 0
		shim := testShim(t, func(w http.ResponseWriter, r *http.Request) {
			id := strings.TrimPrefix(r.URL.Path, "/api/tasks/")
			w.Header().Set("Content-Type", "application/json")
			switch {
			case r.Method == http.MethodPost && r.URL.Path == "/api/tasks":
				var cfg api.TaskConfig
				_ = json.NewDecoder(r.Body).Decode(&cfg)
				answer := tc.answer
				if strings.Contains(answer, "%s") {
					answer = fmt.Sprintf(answer, cfg.ID)
				}
				_, _ = w.Write([]byte(answer))
			case r.Method == http.MethodGet && id != r.URL.Path:
				mu.Lock()
				gets++
				mu.Unlock()
				_, _ = fmt.Fprintf(w, `{"id":%q,"status":"running","ports":[]}`, id)
			default:
				http.NotFound(w, r)
			}
		})
		r, err := NewRun(onShim(shim, &fakeClock{now: time.Unix(1000, 0)}), RunOptions{Commands: []string{"true"}, Network: "bridge"})
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		info, err := r.c.submitTask(ctx, taskConfig(r.o, r.id, r.name))
		if err != nil {
			t.Fatalf("%s: submit: %v", tc.name, err)
		}
		got, err := r.c.waitTask(ctx, r.id, "i", info, nil)
		if err != nil || got.Status != api.TaskRunning || got.ID != r.id {
			t.Fatalf("%s: %+v, %v", tc.name, got, err)
		}
		mu.Lock()
		n := gets
		mu.Unlock()
		if n != tc.wantGets {
			t.Errorf("%s: %d looks after the submit, want %d", tc.name, n, tc.wantGets)
		}
	}
}

// On the host network a Tandem shim's hello says where runners answer,
// and its submit is answered once the task runs: the run waits for its
// runner beside the submit (over a long link that is the runner's
// connection and first healthcheck off the critical path), and StartJob
// takes the runner it found.
func TestHostRunWaitsForItsRunnerBesideTheSubmit(t *testing.T) {
	probed := make(chan struct{})
	var once sync.Once
	runner := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/api/healthcheck" {
			http.NotFound(w, r)
			return
		}
		once.Do(func() { close(probed) })
		w.Header().Set("Content-Type", "application/json")
		_, _ = fmt.Fprintf(w, `{"service":"dstack-runner","version":"0.21.3","tandem_task_id":%q}`, r.URL.Query().Get("tandem_task"))
	}))
	t.Cleanup(runner.Close)
	_, port, _ := net.SplitHostPort(runner.Listener.Addr().String())
	var beforeAnswer atomic.Bool
	shim := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		switch {
		case r.URL.Path == "/api/healthcheck":
			_, _ = fmt.Fprintf(w, `{"service":"dstack-shim","version":"0.21.3","tandem_version":"0.1.0","tandem_runner_http_port":%s}`, port)
		case r.Method == http.MethodGet && r.URL.Path == "/api/tasks":
			_, _ = w.Write([]byte(`{"tasks":[]}`))
		case r.Method == http.MethodPost && r.URL.Path == "/api/tasks":
			var cfg api.TaskConfig
			_ = json.NewDecoder(r.Body).Decode(&cfg)
			select {
			case <-probed:
				beforeAnswer.Store(true)
			case <-time.After(5 * time.Second):
			}
			_, _ = fmt.Fprintf(w, `{"ID":%q,"Status":"running","Ports":[],"tandem":{"network_mode":"host","runner_http_port":%s}}`, cfg.ID, port)
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(shim.Close)
	run, err := NewRun(testClient(t, Config{Shim: strings.TrimPrefix(shim.URL, "http://")}), RunOptions{Commands: []string{"true"}, Network: "host"})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := run.Submit(ctx); err != nil {
		t.Fatal(err)
	}
	if !beforeAnswer.Load() {
		t.Fatal("the runner was first asked only after the submit was answered")
	}
	if err := run.WaitTask(ctx); err != nil {
		t.Fatal(err)
	}
	if run.probe == nil {
		t.Fatal("WaitTask dropped the runner the submit's probe found")
	}
	if r, err := run.probe.result(ctx); err != nil || r == nil {
		t.Fatalf("probe: %v, %v", r, err)
	}
}
