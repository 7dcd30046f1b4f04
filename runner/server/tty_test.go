package server

import (
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/runner/executor"
)

// submitTTY submits a job of sh -c cmd with a terminal of size and the
// stdin mode given; it returns the submit's status.
func submitTTY(t *testing.T, url, cmd, mode string, size api.TermSize) int {
	t.Helper()
	wd := t.TempDir()
	body, _ := json.Marshal(api.SubmitBody{JobSpec: api.JobSpec{Commands: []string{"sh", "-c", cmd}, WorkingDir: &wd, RepoDir: &wd},
		Tandem: &api.SubmitExtras{Stdin: mode, TTY: &size}})
	resp, err := http.Post(url+"/api/submit", "application/json", strings.NewReader(string(body)))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

func startJob(t *testing.T, url string) {
	t.Helper()
	resp, err := http.Post(url+"/api/run", "application/json", nil)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("run: %v %v", err, resp)
	}
	resp.Body.Close()
}

// jobOutput waits for the job's end and returns its output, with "\n"
// line ends.
func jobOutput(t *testing.T, x *executor.Executor) string {
	t.Helper()
	select {
	case <-x.Finished():
	case <-time.After(30 * time.Second):
		t.Fatal("the job did not end")
	}
	return pulled(x)
}

// pulled is the job's output so far, with "\n" line ends.
func pulled(x *executor.Executor) string {
	p, _ := x.Pull(0)
	var out strings.Builder
	for _, l := range p.JobLogs {
		out.Write(l.Message)
	}
	return strings.ReplaceAll(out.String(), "\r\n", "\n")
}

func resize(rows, cols int) []byte {
	b, _ := json.Marshal(api.StdinControl{Resize: &api.TermSize{Rows: rows, Cols: cols}})
	return b
}

// TestStdinWSTerminal (docker run -it): a job given a terminal size and a
// streamed stdin has its terminal on fd 0 at that size; a resize reaches
// it (SIGWINCH and the new size), and the input is typed at the terminal:
// Ctrl-C (0x03) is the job's SIGINT, a line is read as typed.
func TestStdinWSTerminal(t *testing.T) {
	x := testExecutor(t)
	srv := testHTTP(t, x)
	u := "ws" + strings.TrimPrefix(srv.URL, "http") + api.StdinPath
	job := `stty size; echo ready; read -r l; echo "line:$l"; trap 'echo winch $(stty size)' WINCH; trap 'echo got-int; exit 7' INT;` +
		` echo armed; i=0; while [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done; echo no-int`
	if code := submitTTY(t, srv.URL, job, api.StdinStream, api.TermSize{Rows: 30, Cols: 100}); code != http.StatusOK {
		t.Fatalf("submit: %d", code)
	}
	conn, _, err := websocket.DefaultDialer.Dial(u, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	startJob(t, srv.URL)
	waitOutput(t, x, "ready")
	if err := conn.WriteMessage(websocket.BinaryMessage, []byte("typed\r")); err != nil {
		t.Fatal(err)
	}
	waitOutput(t, x, "armed")
	if err := conn.WriteMessage(websocket.TextMessage, resize(40, 120)); err != nil {
		t.Fatal(err)
	}
	waitOutput(t, x, "winch 40 120")
	if err := conn.WriteMessage(websocket.BinaryMessage, []byte{0x03}); err != nil {
		t.Fatal(err)
	}
	out := jobOutput(t, x)
	for _, want := range []string{"30 100\n", "winch 40 120\n", "line:typed\n", "got-int\n"} {
		if !strings.Contains(out, want) {
			t.Errorf("the job's output lacks %q:\n%s", want, out)
		}
	}
	if ev, _ := x.FinalState(); ev.ExitStatus == nil || *ev.ExitStatus != 7 {
		t.Errorf("the job's end: %+v, want exit 7 (its INT trap)", ev)
	}
}

// waitOutput waits until the job's output holds want.
func waitOutput(t *testing.T, x *executor.Executor, want string) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if strings.Contains(pulled(x), want) {
			return
		}
	}
	t.Fatalf("the job never printed %q", want)
}

// TestStdinWSTerminalRefusals: a size out of bounds is refused at the
// submit (400); a TTY job without input has its stream for resizes, and
// the stream closes, with the reason, at input (1003), at a control it
// cannot read (1007) and at one past the bound (1009); the job runs on.
func TestStdinWSTerminalRefusals(t *testing.T) {
	for _, s := range []api.TermSize{{Rows: 0, Cols: 80}, {Rows: 24, Cols: 10001}, {Rows: -1, Cols: -1}, {Rows: 1 << 16, Cols: 80}} {
		x := testExecutor(t)
		srv := testHTTP(t, x)
		if code := submitTTY(t, srv.URL, "true", api.StdinNone, s); code != http.StatusBadRequest {
			t.Errorf("submit of tty %+v: %d, want 400", s, code)
		}
	}
	for _, tc := range []struct {
		name string
		typ  int
		msg  []byte
		code int
		text string
	}{
		{"input", websocket.BinaryMessage, []byte("x"), websocket.CloseUnsupportedData, "the job reads no input"},
		{"bad control", websocket.TextMessage, []byte(`{"resize":{"rows":0,"cols":80}}`), websocket.CloseInvalidFramePayloadData, "bad terminal size"},
		{"unknown control", websocket.TextMessage, []byte(`{"signal":"` + strings.Repeat("x", 900) + `"}`), websocket.CloseInvalidFramePayloadData, "unknown field"},
		{"large control", websocket.TextMessage, []byte(strings.Repeat(" ", api.MaxStdinControl) + "{}"), websocket.CloseMessageTooBig, "at most 1024 bytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x := testExecutor(t)
			srv := testHTTP(t, x)
			// The job's stdin ends at once (fd 0 is no terminal).
			if code := submitTTY(t, srv.URL, `read -r l || echo stdin-ended; exec sleep 60`,
				api.StdinNone, api.TermSize{Rows: 24, Cols: 80}); code != http.StatusOK {
				t.Fatalf("submit: %d", code)
			}
			conn, _, err := websocket.DefaultDialer.Dial("ws"+strings.TrimPrefix(srv.URL, "http")+api.StdinPath, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			startJob(t, srv.URL)
			waitOutput(t, x, "stdin-ended")
			if err := conn.WriteMessage(tc.typ, tc.msg); err != nil {
				t.Fatal(err)
			}
			_ = conn.SetReadDeadline(time.Now().Add(20 * time.Second))
			_, _, err = conn.ReadMessage()
			var ce *websocket.CloseError
			if !errors.As(err, &ce) || ce.Code != tc.code || !strings.Contains(ce.Text, tc.text) {
				t.Fatalf("the stream's end: %v, want %d with %q", err, tc.code, tc.text)
			}
			// The job runs on: the stream's end is its own.
			if x.State() != executor.ServeLogs {
				t.Fatalf("the job after its stream closed: %s", x.State())
			}
			x.Stop()
			<-x.Finished()
		})
	}
}
