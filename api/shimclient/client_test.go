package shimclient

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/tandem-run/tandem/api"
)

// fakeShim records requests and answers with canned shim responses.
type fakeShim struct {
	t        *testing.T
	lastBody map[string]string
}

func (f *fakeShim) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	f.lastBody[r.Method+" "+r.URL.EscapedPath()] = string(b)
	if len(b) > 0 && r.Header.Get("Content-Type") != "application/json" {
		f.t.Errorf("%s %s: body sent without JSON content type", r.Method, r.URL.Path)
	}
	writeJSON := func(v any) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(v)
	}
	switch r.Method + " " + r.URL.EscapedPath() {
	case "GET /api/healthcheck":
		writeJSON(api.HealthcheckResponse{Service: "dstack-shim", Version: "0.21.2+tandem.0.1.0"})
	case "GET /api/tasks":
		// An old shim (0.18.34-0.19.25) answers with bare ids.
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"ids":["a","b"]}`+"\n")
	case "POST /api/tasks":
		http.Error(w, "request error: task t1 is already submitted", http.StatusConflict)
	case "GET /api/tasks/t%2F1":
		writeJSON(api.TaskInfoResponse{ID: "t/1", Status: api.TaskRunning, Ports: []api.PortMapping{}, GPUIDs: []string{}})
	case "GET /api/tasks/missing":
		http.Error(w, "Not Found", http.StatusNotFound)
	case "POST /api/tasks/t1/terminate":
		writeJSON(api.TaskInfoResponse{ID: "t1", Status: api.TaskTerminated, TerminationReason: api.ReasonTerminatedByUser})
	case "POST /api/tasks/t1/remove", "POST /api/shutdown", "POST /api/components/install":
		http.Error(w, "", http.StatusOK)
	case "GET /api/components":
		writeJSON(api.ComponentListResponse{Components: []api.ComponentInfo{{Name: api.ComponentRunner, Status: api.ComponentNotInstalled}}})
	case "GET /metrics/tasks/t1":
		w.Header().Set("Content-Type", "text/plain")
		_, _ = io.WriteString(w, "DCGM_FI_DEV_GPU_UTIL{UUID=\"GPU-1\"} 5\n")
	case "GET /api/instance/info":
		_, _ = io.WriteString(w, "not json")
	default:
		http.NotFound(w, r)
	}
}

func TestClientOverTCPAndUnix(t *testing.T) {
	fake := &fakeShim{t: t, lastBody: map[string]string{}}
	tcp := httptest.NewServer(fake)
	defer tcp.Close()

	sock := filepath.Join(t.TempDir(), "shim.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	unix := &http.Server{Handler: fake}
	go func() { _ = unix.Serve(ln) }()
	defer unix.Close()

	for _, addr := range []string{tcp.Listener.Addr().String(), tcp.URL, "unix://" + sock} {
		t.Run(addr, func(t *testing.T) {
			c, err := New(addr)
			if err != nil {
				t.Fatal(err)
			}
			ctx := t.Context()
			hc, err := c.Healthcheck(ctx)
			if err != nil || hc.Service != "dstack-shim" {
				t.Fatalf("healthcheck: %+v %v", hc, err)
			}
			items, err := c.ListTasks(ctx)
			if err != nil || len(items) != 2 || items[0].ID != "a" || items[0].Status != "" {
				t.Fatalf("legacy ids list: %+v %v", items, err)
			}
			err = c.SubmitTask(ctx, api.TaskConfig{ID: "t1", Name: "n", ImageName: "i"})
			var se *api.StatusError
			if !errors.Is(err, api.ErrConflict) || !errors.As(err, &se) || se.Message != "request error: task t1 is already submitted" {
				t.Fatalf("submit conflict: %v", err)
			}
			var sent api.TaskConfig
			if err := json.Unmarshal([]byte(fake.lastBody["POST /api/tasks"]), &sent); err != nil || sent.ID != "t1" {
				t.Fatalf("submit body: %q %v", fake.lastBody["POST /api/tasks"], err)
			}
			info, err := c.GetTask(ctx, "t/1")
			if err != nil || info.ID != "t/1" || info.Ports == nil {
				t.Fatalf("get task with escaped id: %+v %v", info, err)
			}
			if _, err := c.GetTask(ctx, "missing"); !errors.Is(err, api.ErrNotFound) {
				t.Fatalf("missing task: %v", err)
			}
			info, err = c.TerminateTask(ctx, "t1", api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser, Timeout: 3})
			if err != nil || info.TerminationReason != api.ReasonTerminatedByUser {
				t.Fatalf("terminate: %+v %v", info, err)
			}
			if got := fake.lastBody["POST /api/tasks/t1/terminate"]; got != `{"termination_reason":"terminated_by_user","termination_message":"","timeout":3}` {
				t.Fatalf("terminate body %s", got)
			}
			if err := c.RemoveTask(ctx, "t1"); err != nil {
				t.Fatalf("remove: %v", err)
			}
			if err := c.Shutdown(ctx, false); err != nil || fake.lastBody["POST /api/shutdown"] != `{"force":false}` {
				t.Fatalf("shutdown: %v %q", err, fake.lastBody["POST /api/shutdown"])
			}
			if err := c.InstallComponent(ctx, api.ComponentRunner, "http://x/r"); err != nil {
				t.Fatalf("install: %v", err)
			}
			comps, err := c.Components(ctx)
			if err != nil || len(comps) != 1 || comps[0].Status != api.ComponentNotInstalled {
				t.Fatalf("components: %+v %v", comps, err)
			}
			m, err := c.TaskMetrics(ctx, "t1")
			if err != nil || m != "DCGM_FI_DEV_GPU_UTIL{UUID=\"GPU-1\"} 5\n" {
				t.Fatalf("metrics: %q %v", m, err)
			}
			if _, err := c.InstanceInfo(ctx); err == nil {
				t.Fatal("a non-JSON answer must be an error")
			}
		})
	}
}

func TestNewRejectsBadAddresses(t *testing.T) {
	for _, addr := range []string{"", "localhost", "https://x:1", "unix://", "ftp://x:1"} {
		if _, err := New(addr); err == nil {
			t.Errorf("New(%q) should fail", addr)
		}
	}
}

// Submit returns the shim's answer as a task info, Tandem's details
// included; an answer that is not the task (an older shim's, or none) is
// the zero info and no error: the task was accepted all the same.
func TestSubmitReturnsTheAnswer(t *testing.T) {
	for _, tc := range []struct {
		answer, ctype string
		want          api.TaskInfoResponse
	}{
		{`{"ID":"t1","Status":"running","Ports":[{"Host":1,"Container":2}],"ContainerID":"c","GpuIDs":[],"tandem":{"name":"n","image_name":"i","network_mode":"bridge","gpu":0,"runner_http_port":1}}`, "application/json",
			api.TaskInfoResponse{ID: "t1", Status: api.TaskRunning, Ports: []api.PortMapping{{Host: 1, Container: 2}}, ContainerID: "c", GPUIDs: []string{},
				Tandem: &api.TaskDetails{Name: "n", ImageName: "i", NetworkMode: "bridge", RunnerHTTPPort: 1}}},
		{`{"ID":"other","Status":"running"}`, "application/json", api.TaskInfoResponse{}},
		{``, "text/plain", api.TaskInfoResponse{}},
		{`not json`, "application/json", api.TaskInfoResponse{}},
	} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", tc.ctype)
			_, _ = w.Write([]byte(tc.answer))
		}))
		c, err := New(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		got, err := c.Submit(context.Background(), api.TaskConfig{ID: "t1", Name: "n", ImageName: "i"})
		srv.Close()
		if err != nil || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("answer %q: %+v, %v; want %+v", tc.answer, got, err, tc.want)
		}
	}
}
