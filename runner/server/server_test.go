package server

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/runner/executor"
)

// testExecutor is a fresh executor in a temp dir, closed after the test.
func testExecutor(t testing.TB) *executor.Executor {
	t.Helper()
	x, err := executor.New(executor.Config{TempDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = x.Close() })
	return x
}

// testHTTP serves x's API on a local HTTP server until the test ends.
func testHTTP(t testing.TB, x *executor.Executor) *httptest.Server {
	srv := httptest.NewServer(New(Deps{Version: "test", Executor: x, Log: logging.Discard()}))
	t.Cleanup(srv.Close)
	return srv
}

func newTestServer(t testing.TB) http.Handler {
	x := testExecutor(t)
	t.Cleanup(func() {
		// A request may have started a job (a submit that asks to run):
		// it ends before its temp dir goes.
		if x.State() == executor.ServeLogs {
			x.Stop()
			<-x.Finished()
		}
	})
	return New(Deps{Version: "test", Executor: x, Log: logging.Discard()})
}

func do(h http.Handler, method, path, ctype, body string) (int, string) {
	req := httptest.NewRequest(method, path, strings.NewReader(body))
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	b, _ := io.ReadAll(rec.Body)
	return rec.Code, string(b)
}

func part(name, filename string) string {
	disp := `form-data; name="` + name + `"`
	if filename != "" {
		disp += `; filename="` + filename + `"`
	}
	return "--B\r\nContent-Disposition: " + disp + "\r\n\r\ndata\r\n"
}

func TestUploadArchiveTexts(t *testing.T) {
	h := newTestServer(t)
	if code, body := do(h, "POST", "/api/upload_archive", "", ""); code != 409 {
		t.Fatalf("before submit: %d %q", code, body)
	}
	if code, body := do(h, "POST", "/api/submit", "application/json", `{"job_spec":{"commands":["true"]},"unknown":1}`); code != 200 || body != "\n" {
		t.Fatalf("submit: %d %q", code, body)
	}
	mp := "multipart/form-data; boundary=B"
	tests := []struct{ ctype, body, want string }{
		{"", "", "missing content-type header\n"},
		{"text/plain", "", "multipart/form-data expected, got text/plain\n"},
		{"multipart/form-data", "", "missing boundary\n"},
		{mp, "--B--\r\n", "empty form\n"},
		{mp, part("", "x") + "--B--\r\n", "missing field name\n"},
		{mp, part("file", "x") + "--B--\r\n", "unexpected field file\n"},
		{mp, part("archive", "") + "--B--\r\n", "missing file name\n"},
		{mp, part("archive", "../x") + "--B--\r\n", "bad input: archive id \"../x\" must start with a letter or digit\n"},
		{mp, part("archive", "a/b") + "--B--\r\n", "bad input: archive id \"a/b\" contains '/' at byte 1; allowed are letters, digits and . _ -\n"},
		{mp, part("archive", "id1") + part("archive", "id2") + "--B--\r\n", "extra form field(s)\n"},
		{"multipart/form-data; boundary=\"", "", "malformed content-type header: mime: invalid media parameter\n"},
	}
	for _, tc := range tests {
		code, body := do(h, "POST", "/api/upload_archive", tc.ctype, tc.body)
		if code != 400 || body != tc.want {
			t.Errorf("%q %q: %d %q want 400 %q", tc.ctype, tc.body, code, body, tc.want)
		}
	}
	if code, body := do(h, "POST", "/api/upload_archive", mp, part("archive", "id1")+"--B--\r\n"); code != 200 || body != "\n" {
		t.Fatalf("good upload: %d %q", code, body)
	}
	if code, body := do(h, "GET", "/api/pull?timestamp=abc", "", ""); code != 400 {
		t.Fatalf("bad timestamp: %d %q", code, body)
	}
	if code, _ := do(h, "POST", "/api/submit", "application/json", `{"job_spec":{"commands":"ls"}}`); code != 400 {
		t.Fatal("wrong type must be 400")
	}
}

func TestUploadLimits(t *testing.T) {
	x, err := executor.New(executor.Config{TempDir: t.TempDir(), MaxUpload: 1000, MaxUploadTotal: 1500})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = x.Close() })
	h := New(Deps{Version: "test", Executor: x, Log: logging.Discard()})
	if code, body := do(h, "POST", "/api/submit", "application/json", `{}`); code != 200 {
		t.Fatalf("submit: %d %q", code, body)
	}
	mp := "multipart/form-data; boundary=B"
	upload := func(id string, n int) (int, string) {
		return do(h, "POST", "/api/upload_archive", mp,
			"--B\r\nContent-Disposition: form-data; name=\"archive\"; filename=\""+id+"\"\r\n\r\n"+strings.Repeat("x", n)+"\r\n--B--\r\n")
	}
	if code, body := do(h, "POST", "/api/upload_code", "", strings.Repeat("c", 1001)); code != 413 || !strings.Contains(body, "more than 1000 bytes") {
		t.Fatalf("oversized code: %d %q", code, body)
	}
	if code, _ := upload("a1", 1000); code != 200 {
		t.Fatalf("archive at the limit: %d", code)
	}
	// Re-uploading the same id replaces it and does not count twice.
	if code, _ := upload("a1", 900); code != 200 {
		t.Fatalf("replaced archive: %d", code)
	}
	if code, body := upload("a2", 700); code != 413 || !strings.Contains(body, "1500 bytes in all") {
		t.Fatalf("over the job total: %d %q", code, body)
	}
	if code, _ := upload("a3", 600); code != 200 {
		t.Fatalf("within the job total: %d", code)
	}
	entries, _ := os.ReadDir(filepath.Join(x.TempDir(), "file_archives"))
	if len(entries) != 2 {
		t.Fatalf("stored archives: %v (a refused upload must leave nothing)", entries)
	}
}

func FuzzRunnerRequests(f *testing.F) {
	f.Add(0, "application/json", `{"job_spec":{"commands":["a"],"user":{"uid":1}},"log_quota_hour":null}`)
	f.Add(1, "multipart/form-data; boundary=B", part("archive", "x")+"--B--\r\n")
	f.Add(2, "", "diff --git")
	f.Add(3, "", "")
	f.Add(0, "application/json", `{"job_spec":{"commands":["cat"]},"tandem":{"stdin":"stream"}}`)
	f.Add(0, "application/json", `{"job_spec":{"commands":["cat"]},"tandem":{"run":true}}`)
	f.Add(0, "application/json", `{"job_spec":{"commands":["cat"]},"tandem":{"stdin":"stream","tty":{"rows":0,"cols":70000}}}`)
	paths := []string{"/api/submit", "/api/upload_archive", "/api/upload_code", "/api/pull?timestamp=1"}
	f.Fuzz(func(t *testing.T, which int, ctype, body string) {
		h := newTestServer(t)
		_, _ = do(h, "POST", "/api/submit", "application/json", `{}`)
		p := paths[((which%len(paths))+len(paths))%len(paths)]
		method := "POST"
		if strings.HasPrefix(p, "/api/pull") {
			method = "GET"
		}
		if code, msg := do(h, method, p, ctype, body); code >= 500 {
			t.Fatalf("%s %q %q: %d %q", p, ctype, body, code, msg)
		}
	})
}

// A failure inside the runner reaches the client as a chosen text: no
// path of the runner's, no Go wording.
func TestInternalErrorsAreNotSent(t *testing.T) {
	dir := t.TempDir()
	x, err := executor.New(executor.Config{TempDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = x.Close() })
	h := New(Deps{Version: "test", Executor: x, Log: logging.Discard()})
	if code, body := do(h, "POST", "/api/submit", "application/json", `{"job_spec":{"commands":["true"]}}`); code != 200 {
		t.Fatalf("submit: %d %q", code, body)
	}
	// Where the upload goes is a file now: writing it fails.
	if err := os.WriteFile(filepath.Join(dir, "repo_blobs"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	code, body := do(h, "POST", "/api/upload_code", "application/octet-stream", "code")
	if code != 500 || body != "internal error: the request failed (the agent's log has the cause)\n" {
		t.Fatalf("upload_code: %d %q", code, body)
	}
	if strings.Contains(body, dir) || strings.Contains(body, "not a directory") {
		t.Fatalf("the body carries the cause: %q", body)
	}
}

// A Tandem client's submit that asks to run starts the job at once and
// answers with /api/run's answer (started: true); a run after it is out
// of turn. A submit without the ask answers as dstack's runner does and
// leaves the job waiting for /api/run.
func TestSubmitThatAsksToRunStartsTheJob(t *testing.T) {
	h := newTestServer(t)
	code, body := do(h, http.MethodPost, "/api/submit", "application/json", `{"job_spec":{"commands":["true"]}}`)
	if code != http.StatusOK || strings.Contains(body, "started") {
		t.Fatalf("plain submit: %d %q", code, body)
	}
	h = newTestServer(t)
	code, body = do(h, http.MethodPost, "/api/submit", "application/json", `{"job_spec":{"commands":["true"]},"tandem":{"run":true}}`)
	var rr api.SubmitRunResponse
	if code != http.StatusOK || json.Unmarshal([]byte(body), &rr) != nil || !rr.Started || rr.WorkingDir == "" {
		t.Fatalf("submit that asks to run: %d %q", code, body)
	}
	if code, body := do(h, http.MethodPost, "/api/run", "", ""); code != http.StatusConflict {
		t.Fatalf("run after a submit that ran: %d %q", code, body)
	}
}

// An onlooker's states-only pull (peek=1&logs=0, tandem attach) does not
// collect the job's logs; the driver's (logs=0) does.
func TestPeekAtStatesIsRoutedAsAnOnlooker(t *testing.T) {
	x := testExecutor(t)
	h := New(Deps{Version: "test", Executor: x, Log: logging.Discard()})
	wd := t.TempDir()
	submit := `{"job_spec":{"commands":["true"],"working_dir":"` + wd + `","repo_dir":"` + wd + `"},"tandem":{"run":true}}`
	if code, body := do(h, http.MethodPost, "/api/submit", "application/json", submit); code != http.StatusOK {
		t.Fatalf("submit: %d %q", code, body)
	}
	select {
	case <-x.Finished():
	case <-time.After(30 * time.Second):
		t.Fatal("the job did not end")
	}
	code, body := do(h, http.MethodGet, "/api/pull?peek=1&logs=0&timestamp=0", "", "")
	if code != http.StatusOK || !strings.Contains(body, `"done"`) || strings.Contains(body, `"message"`) {
		t.Fatalf("peek at the states: %d %q", code, body)
	}
	select {
	case <-x.PullConsumed():
		t.Fatal("an onlooker's peek collected the logs")
	default:
	}
	if code, _ := do(h, http.MethodGet, "/api/pull?logs=0&timestamp=0", "", ""); code != http.StatusOK {
		t.Fatalf("the driver's pull: %d", code)
	}
	select {
	case <-x.PullConsumed():
	default:
		t.Fatal("the driver's states-only pull of the end did not collect")
	}
}

// /logs_ws asked with tandem_end=1 ends, after the whole output, with one
// text message holding the job's final state, then the close; asked
// without it, it sends the output only (dstack's shape).
func TestLogsWSSendsTheEndWhenAsked(t *testing.T) {
	x := testExecutor(t)
	srv := testHTTP(t, x)
	wd := t.TempDir()
	submit := `{"job_spec":{"commands":["sh","-c","echo out; exit 3"],"working_dir":"` + wd + `","repo_dir":"` + wd + `"},"tandem":{"run":true}}`
	resp, err := http.Post(srv.URL+"/api/submit", "application/json", strings.NewReader(submit))
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("submit: %v %v", err, resp)
	}
	resp.Body.Close()
	for _, asked := range []bool{true, false} {
		u := "ws" + strings.TrimPrefix(srv.URL, "http") + "/logs_ws"
		if asked {
			u += "?" + api.LogsEndParam + "=1"
		}
		conn, _, err := websocket.DefaultDialer.Dial(u, nil)
		if err != nil {
			t.Fatal(err)
		}
		var out strings.Builder
		var end *api.JobStateEvent
		for {
			typ, b, err := conn.ReadMessage()
			if err != nil {
				if !websocket.IsCloseError(err, websocket.CloseNoStatusReceived, websocket.CloseNormalClosure) {
					t.Fatalf("asked %v: %v", asked, err)
				}
				break
			}
			if end != nil {
				t.Fatalf("asked %v: a message after the end: %q", asked, b)
			}
			if typ == websocket.TextMessage {
				var m api.LogsEnd
				if err := json.Unmarshal(b, &m); err != nil || m.End == nil {
					t.Fatalf("asked %v: text message %q", asked, b)
				}
				end = m.End
				continue
			}
			out.Write(b)
		}
		conn.Close()
		if !strings.Contains(out.String(), "out") {
			t.Errorf("asked %v: output %q", asked, out.String())
		}
		switch {
		case asked && (end == nil || end.State != api.JobFailed || end.ExitStatus == nil || *end.ExitStatus != 3):
			t.Errorf("asked: end %+v", end)
		case !asked && end != nil:
			t.Errorf("not asked: end %+v", end)
		}
	}
}

// /logs_ws asked for the output so far sends what the running job wrote
// and closes, while the job runs on; without the parameter it follows.
func TestLogsWSSoFarEndsWhileTheJobRuns(t *testing.T) {
	x := testExecutor(t)
	t.Cleanup(func() { // the job's end, before its dirs go
		x.Stop()
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			if _, ended := x.FinalState(); ended {
				return
			}
		}
		t.Error("the job did not end on its stop")
	})
	srv := testHTTP(t, x)
	wd := t.TempDir()
	read := func(u string) (string, error) {
		conn, _, err := websocket.DefaultDialer.Dial(u, nil)
		if err != nil {
			return "", err
		}
		defer conn.Close()
		_ = conn.SetReadDeadline(time.Now().Add(2 * time.Second))
		var out strings.Builder
		for {
			_, b, err := conn.ReadMessage()
			if err != nil {
				if websocket.IsCloseError(err, websocket.CloseNoStatusReceived, websocket.CloseNormalClosure) {
					return out.String(), nil
				}
				return out.String(), err
			}
			out.Write(b)
		}
	}
	base := "ws" + strings.TrimPrefix(srv.URL, "http") + "/logs_ws"
	// Before the job: no output, and the stream closes at once.
	if got, err := read(base + "?" + api.LogsSoFarParam + "=1"); err != nil || got != "" {
		t.Fatalf("so far before the job: %q, %v", got, err)
	}
	submit := `{"job_spec":{"commands":["sh","-c","echo first; exec sleep 60"],"working_dir":"` + wd + `","repo_dir":"` + wd + `"},"tandem":{"run":true}}`
	resp, err := http.Post(srv.URL+"/api/submit", "application/json", strings.NewReader(submit))
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("submit: %v %v", err, resp)
	}
	resp.Body.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got, err := read(base + "?" + api.LogsSoFarParam + "=1")
		if err != nil {
			t.Fatalf("so far: %q, %v (it should close, not follow)", got, err)
		}
		if strings.Contains(got, "first") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("so far: %q after 10 s", got)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if got, err := read(base + "?start_time=" + url.QueryEscape(time.Now().Add(time.Hour).Format(time.RFC3339Nano)) + "&" + api.LogsSoFarParam + "=1"); err != nil || got != "" {
		t.Fatalf("so far since a later time: %q, %v", got, err)
	}
	if got, err := read(base); err == nil || !strings.Contains(got, "first") {
		t.Fatalf("following: %q, %v (want the output, then the read deadline)", got, err)
	}
}

// A call that names another shim task than the runner's own is refused
// with 409 before anything is done (the output stream is not opened); one
// that names this task, or none, passes, and so does any call to a runner
// told no task.
func TestCallsNamingAnotherTaskAreRefused(t *testing.T) {
	x := testExecutor(t)
	h := New(Deps{Version: "test", TaskID: "task-b", Executor: x, Log: logging.Discard()})
	for _, path := range []string{"/api/healthcheck", "/api/pull?timestamp=0", "/logs_ws"} {
		sep := "?"
		if strings.Contains(path, "?") {
			sep = "&"
		}
		code, body := do(h, http.MethodGet, path+sep+api.RunnerTaskParam+"=task-a", "", "")
		if code != http.StatusConflict || !strings.Contains(body, "serves task task-b, not task-a") {
			t.Errorf("%s naming another task: %d %q", path, code, body)
		}
		if path == "/logs_ws" {
			continue // a plain GET is no upgrade either way
		}
		if code, body := do(h, http.MethodGet, path+sep+api.RunnerTaskParam+"=task-b", "", ""); code != http.StatusOK {
			t.Errorf("%s naming its own task: %d %q", path, code, body)
		}
		if code, body := do(h, http.MethodGet, path, "", ""); code != http.StatusOK {
			t.Errorf("%s naming none: %d %q", path, code, body)
		}
	}
	if code, _ := do(h, http.MethodPost, "/api/submit?"+api.RunnerTaskParam+"=task-a", "application/json", `{"job_spec":{"commands":["true"]}}`); code != http.StatusConflict || x.State() != executor.WaitSubmit {
		t.Errorf("a submit naming another task: %d, state %s", code, x.State())
	}
	untold := New(Deps{Version: "test", Executor: x, Log: logging.Discard()})
	if code, body := do(untold, http.MethodGet, "/api/healthcheck?"+api.RunnerTaskParam+"=task-a", "", ""); code != http.StatusOK {
		t.Errorf("a runner told no task: %d %q", code, body)
	}
}

// TestStdinWS: a job submitted with a streamed stdin reads the client's
// binary messages in order (a text one is a control: a resize) and the end of
// file the client's close means; its output shows both. A second client,
// or a job submitted without the mode, is refused with 409 before any
// upgrade; a client with nothing to send is told when the job ends.
func TestStdinWS(t *testing.T) {
	x := testExecutor(t)
	srv := testHTTP(t, x)
	u := "ws" + strings.TrimPrefix(srv.URL, "http") + api.StdinPath
	submit := func(cmd, mode string) {
		t.Helper()
		wd := t.TempDir()
		body, _ := json.Marshal(api.SubmitBody{JobSpec: api.JobSpec{Commands: []string{"sh", "-c", cmd}, WorkingDir: &wd, RepoDir: &wd},
			Tandem: &api.SubmitExtras{Stdin: mode}})
		resp, err := http.Post(srv.URL+"/api/submit", "application/json", strings.NewReader(string(body)))
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("submit: %v %v", err, resp)
		}
		resp.Body.Close()
	}
	submit("true", api.StdinNone)
	if _, resp, err := websocket.DefaultDialer.Dial(u, nil); err == nil || resp == nil || resp.StatusCode != http.StatusConflict {
		t.Fatalf("stdin of a job without the mode: %v %v", err, resp)
	}
	submit(`while read -r l; do echo "line:$l"; done; echo "eof"`, api.StdinStream)
	// A plain GET is not a client: the input stays for the next one.
	if resp, err := http.Get(srv.URL + api.StdinPath); err != nil || resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("a plain GET: %v %v", err, resp)
	}
	conn, _, err := websocket.DefaultDialer.Dial(u, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, resp, err := websocket.DefaultDialer.Dial(u, nil); err == nil || resp == nil || resp.StatusCode != http.StatusConflict {
		t.Fatalf("a second client: %v %v", err, resp)
	}
	for _, m := range []struct {
		typ int
		b   string
	}{{websocket.BinaryMessage, "one\ntw"}, {websocket.TextMessage, `{"resize":{"rows":30,"cols":100}}`}, {websocket.BinaryMessage, "o\nthree\n"}} {
		if err := conn.WriteMessage(m.typ, []byte(m.b)); err != nil {
			t.Fatal(err)
		}
	}
	resp, err := http.Post(srv.URL+"/api/run", "application/json", nil)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("run: %v %v", err, resp)
	}
	resp.Body.Close()
	_ = conn.WriteMessage(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""))
	conn.Close()
	if got := jobOutput(t, x); got != "line:one\nline:two\nline:three\neof\n" { // jobOutput waits for the job's end: its input's end seen
		t.Fatalf("the job read %q", got)
	}

	// A client with nothing to send hears of the job's end.
	y := testExecutor(t)
	srv2 := testHTTP(t, y)
	wd := t.TempDir()
	body, _ := json.Marshal(api.SubmitBody{JobSpec: api.JobSpec{Commands: []string{"true"}, WorkingDir: &wd, RepoDir: &wd},
		Tandem: &api.SubmitExtras{Stdin: api.StdinStream}})
	if resp, err := http.Post(srv2.URL+"/api/submit", "application/json", strings.NewReader(string(body))); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("submit: %v %v", err, resp)
	}
	idle, _, err := websocket.DefaultDialer.Dial("ws"+strings.TrimPrefix(srv2.URL, "http")+api.StdinPath, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer idle.Close()
	if resp, err := http.Post(srv2.URL+"/api/run", "application/json", nil); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("run: %v %v", err, resp)
	}
	_ = idle.SetReadDeadline(time.Now().Add(20 * time.Second))
	_, _, err = idle.ReadMessage()
	var ce *websocket.CloseError
	if !errors.As(err, &ce) || ce.Code != websocket.CloseNormalClosure || !strings.Contains(ce.Text, "job ended") {
		t.Fatalf("an idle client at the job's end: %v", err)
	}
}
