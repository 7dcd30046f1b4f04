package runnerclient

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/tandem-run/tandem/api"
)

type fakeRunner struct {
	t        *testing.T
	archives map[string]string
	code     string
	runJSON  bool
	pullTS   string
}

func (f *fakeRunner) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.Method + " " + r.URL.Path {
	case "POST /api/submit":
		var b api.SubmitBody
		if err := json.NewDecoder(r.Body).Decode(&b); err != nil || b.JobSpec.Commands[0] != "echo" {
			http.Error(w, "bad submit", http.StatusBadRequest)
			return
		}
		http.Error(w, "", http.StatusOK)
	case "POST /api/upload_archive":
		mr, err := r.MultipartReader()
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		p, err := mr.NextPart()
		if err != nil || p.FormName() != "archive" {
			http.Error(w, "unexpected field", http.StatusBadRequest)
			return
		}
		b, _ := io.ReadAll(p)
		f.archives[p.FileName()] = string(b)
		if _, err := mr.NextPart(); err != io.EOF {
			http.Error(w, "extra form field(s)", http.StatusBadRequest)
			return
		}
		http.Error(w, "", http.StatusOK)
	case "POST /api/upload_code":
		b, _ := io.ReadAll(r.Body)
		f.code = string(b)
		http.Error(w, "", http.StatusOK)
	case "POST /api/run":
		if !f.runJSON {
			http.Error(w, "", http.StatusOK)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"working_dir":"/w","username":"root"}`+"\n")
	case "GET /api/pull":
		f.pullTS = r.URL.Query().Get("timestamp")
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"job_states":[{"state":"done","timestamp":2,"termination_reason":"","termination_message":"","exit_status":0}],"job_logs":[{"message":"aGkK","timestamp":1}],"runner_logs":[],"last_updated":2,"no_connections_secs":0,"has_more":false}`+"\n")
	case "POST /api/stop":
		http.Error(w, "", http.StatusOK)
	case "GET /api/metrics":
		http.Error(w, "Metrics collector is not available", http.StatusNotFound)
	case "GET /logs_ws":
		up := websocket.Upgrader{}
		c, err := up.Upgrade(w, r, nil)
		if err != nil {
			return
		}
		defer c.Close()
		if st := r.URL.Query().Get("start_time"); st != "" {
			if _, err := time.Parse(time.RFC3339, st); err != nil || strings.HasPrefix(st, "1999") {
				_ = c.WriteMessage(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseUnsupportedData, "failed to parse start_time value"))
				return
			}
		}
		_ = c.WriteMessage(websocket.BinaryMessage, []byte("\x1b[1mhello\r\n"))
		_ = c.WriteMessage(websocket.BinaryMessage, []byte("world\r\n"))
		_ = c.WriteMessage(websocket.CloseMessage, []byte{}) // empty payload, as dstack's runner
	default:
		http.NotFound(w, r)
	}
}

func TestRunnerClient(t *testing.T) {
	fake := &fakeRunner{t: t, archives: map[string]string{}}
	srv := httptest.NewServer(fake)
	defer srv.Close()
	c, err := New(srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	if err := c.Submit(ctx, api.SubmitBody{JobSpec: api.JobSpec{Commands: []string{"echo", "hi"}}}); err != nil {
		t.Fatalf("submit: %v", err)
	}
	if err := c.Submit(ctx, api.SubmitBody{JobSpec: api.JobSpec{Commands: []string{"x"}}}); !errors.Is(err, api.ErrBadRequest) {
		t.Fatalf("rejected submit: %v", err)
	}
	if err := c.UploadArchive(ctx, "5b7a-id", strings.NewReader("tar bytes")); err != nil || fake.archives["5b7a-id"] != "tar bytes" {
		t.Fatalf("archive: %v %+v", err, fake.archives)
	}
	if err := c.UploadCode(ctx, strings.NewReader("diff --git")); err != nil || fake.code != "diff --git" {
		t.Fatalf("code: %v %q", err, fake.code)
	}
	if _, ok, err := c.Run(ctx); err != nil || ok {
		t.Fatalf("non-JSON run answer: ok=%v err=%v", ok, err)
	}
	fake.runJSON = true
	if rr, ok, err := c.Run(ctx); err != nil || !ok || rr.WorkingDir != "/w" || rr.Username != "root" {
		t.Fatalf("run: %+v %v %v", rr, ok, err)
	}
	p, err := c.Pull(ctx, 1760000000123)
	if err != nil || fake.pullTS != "1760000000123" || string(p.JobLogs[0].Message) != "hi\n" || *p.JobStates[0].ExitStatus != 0 {
		t.Fatalf("pull: %+v %v ts=%s", p, err, fake.pullTS)
	}
	if err := c.Stop(ctx); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if _, err := c.Metrics(ctx); !errors.Is(err, api.ErrNotFound) {
		t.Fatalf("metrics 404: %v", err)
	}

	ls, err := c.Logs(ctx, time.Time{})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for {
		b, err := ls.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("logs: %v", err)
		}
		got = append(got, string(b))
	}
	ls.Close()
	if strings.Join(got, "") != "\x1b[1mhello\r\nworld\r\n" {
		t.Fatalf("log frames: %q", got)
	}

	ls, err = c.Logs(ctx, time.Date(1999, 1, 1, 0, 0, 0, 0, time.UTC))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ls.Next(); !errors.Is(err, ErrBadStartTime) {
		t.Fatalf("bad start_time must surface as ErrBadStartTime: %v", err)
	}
	ls.Close()
}

// A stream opened with LogsWithEnd asks for the job's end state
// (tandem_end=1): the runner's text message holding it is not output and
// End returns it; a text message that is no end state is output, as
// before. Output comes in pieces of at most 64 KiB however large a
// message is (a 1 MiB one here: never held whole). Logs does not ask.
func TestLogsWithEnd(t *testing.T) {
	big := bytes.Repeat([]byte("x"), 1<<20)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, err := (&websocket.Upgrader{}).Upgrade(w, r, nil)
		if err != nil {
			return
		}
		defer c.Close()
		asked := r.URL.Query().Get(api.LogsEndParam) == "1"
		_ = c.WriteMessage(websocket.BinaryMessage, []byte("out\n"))
		_ = c.WriteMessage(websocket.TextMessage, []byte(`{"not":"an end"}`))
		_ = c.WriteMessage(websocket.BinaryMessage, big)
		if asked {
			_ = c.WriteMessage(websocket.TextMessage, []byte(`{"tandem_end":{"state":"failed","timestamp":7,"termination_reason":"container_exited_with_error","termination_message":"","exit_status":3}}`))
		}
		_ = c.WriteMessage(websocket.CloseMessage, []byte{})
	}))
	defer srv.Close()
	c, err := New(srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	for _, withEnd := range []bool{true, false} {
		open := c.Logs
		if withEnd {
			open = c.LogsWithEnd
		}
		ls, err := open(context.Background(), time.Time{})
		if err != nil {
			t.Fatal(err)
		}
		var got []byte
		for {
			b, err := ls.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(b) > 64<<10 {
				t.Fatalf("one Next returned %d bytes", len(b))
			}
			got = append(got, b...)
		}
		ls.Close()
		if want := append([]byte(`out
{"not":"an end"}`), big...); !bytes.Equal(got, want) {
			t.Errorf("with end %v: output of %d bytes, want %d (%.40q)", withEnd, len(got), len(want), got)
		}
		end, ok := ls.End()
		if ok != withEnd || (ok && (end.State != api.JobFailed || end.ExitStatus == nil || *end.ExitStatus != 3)) {
			t.Errorf("with end %v: end %+v %v", withEnd, end, ok)
		}
	}
}

// FuzzReadEnd: any text message is either a final end state or handed
// back whole as output (up to the bound), never lost or half-read.
func FuzzReadEnd(f *testing.F) {
	f.Add([]byte(`{"tandem_end":{"state":"done","timestamp":1,"termination_reason":"done_by_runner","termination_message":"","exit_status":0}}`))
	f.Add([]byte(`{"tandem_end":{"state":"running"}}`))
	f.Add([]byte(`{"tandem_end":null}`))
	f.Add([]byte("plain output\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		end, read, ok := readEnd(bytes.NewReader(b))
		if ok {
			if !end.State.Final() || read != nil {
				t.Fatalf("end %+v, read %q", end, read)
			}
			return
		}
		if want := b[:min(len(b), maxEndMessage+1)]; !bytes.Equal(read, want) {
			t.Fatalf("not an end: %d bytes handed back of %d", len(read), len(b))
		}
	})
}
