package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"syscall"
	"testing"
)

// TestTandemHostileAnswers (issue 27): a shim (here a fake) whose answers
// carry escape sequences cannot drive the user's terminal through `tandem
// ps`, and one with a 512 MiB field cannot make tandem hold it. The
// control: the same listing without escapes prints its values as they are.
func TestTandemHostileAnswers(t *testing.T) {
	huge, runnerHuge := false, false
	image, status := "evil\x1b]0;pwned\x07\x1b[2Jimage", "running"
	jobState := "running\x1b]0;runner\x07"
	var fakePort string
	fake := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		switch {
		case r.URL.Path == "/api/tasks" && huge:
			fmt.Fprint(w, `{"ids":["`)
			chunk := strings.Repeat("A", 1<<20)
			for range 512 {
				if _, err := fmt.Fprint(w, chunk); err != nil {
					return
				}
			}
			fmt.Fprint(w, `"]}`)
		case r.URL.Path == "/api/tasks":
			fmt.Fprint(w, `{"ids":["t1"],"tasks":[{"id":"t1","status":"running"}]}`)
		case r.URL.Path == "/api/pull" && runnerHuge: // the runner's answer ps peeks at
			fmt.Fprint(w, `{"job_states":[{"state":"running","timestamp":1}],"job_logs":[],"runner_logs":[{"message":"`)
			chunk := strings.Repeat("QUFB", 1<<18)
			for range 512 {
				if _, err := fmt.Fprint(w, chunk); err != nil {
					return
				}
			}
			fmt.Fprint(w, `","timestamp":1}],"last_updated":1,"has_more":false}`)
		case r.URL.Path == "/api/pull":
			js, _ := json.Marshal(jobState)
			fmt.Fprintf(w, `{"job_states":[{"state":%s,"timestamp":1}],"job_logs":[],"runner_logs":[],"last_updated":1,"has_more":false}`, js)
		case r.URL.Path == "/api/tasks/t1":
			st, _ := json.Marshal(status)
			img, _ := json.Marshal(image)
			fmt.Fprintf(w, `{"id":"t1","status":%s,"termination_reason":"","termination_message":"","ports":[],"container_name":"c","container_id":"x","gpus_ids":[],
				"tandem":{"name":"n\u001b[31m","image_name":%s,"submitted_at":1,"runner_http_port":%s}}`, st, img, fakePort)
		default:
			http.NotFound(w, r)
		}
	}))
	defer fake.Close()
	shim := strings.TrimPrefix(fake.URL, "http://")
	_, fakePort, _ = strings.Cut(shim, ":") // the fake answers as the runner too
	ps := func() (string, string, *syscall.Rusage, error) {
		cmd, out, errb := tandem(t, "ps", "-a", "--shim", shim)
		err := cmd.Run()
		var ru *syscall.Rusage
		if cmd.ProcessState != nil {
			ru, _ = cmd.ProcessState.SysUsage().(*syscall.Rusage)
		}
		return out.String(), errb.String(), ru, err
	}
	out, errOut, _, err := ps()
	if err != nil {
		t.Fatalf("ps: %v %s", err, errOut)
	}
	if strings.ContainsAny(out+errOut, "\x1b\x07") {
		t.Fatalf("an escape sequence reached the terminal: %q", out)
	}
	if !strings.Contains(out, `evil\x1b]0;pwned\x07\x1b[2Jimage`) || !strings.Contains(out, `job unknown (running\x1b]0;runner\x07)`) {
		t.Fatalf("escaped values missing: %q", out)
	}
	// A state of the shim's own that is not a known value.
	status = "running\x1b[2J"
	if out, _, _, err := ps(); err != nil || !strings.Contains(out, `unknown (running\x1b[2J)`) {
		t.Fatalf("the shim's hostile state: %v %q", err, out)
	}
	// Control: ordinary values print as they are.
	image, status, jobState = "ubuntu:22.04", "running", "running"
	out, _, control, err := ps()
	if err != nil || !strings.Contains(out, "ubuntu:22.04") || !strings.Contains(out, "job running") {
		t.Fatalf("control: %v %q", err, out)
	}
	// A child's peak RSS counts the memory of the test process it was
	// forked from (Linux keeps the mm's high-water mark across exec), so
	// the bound is over the control's.
	var base int64
	if control != nil {
		base = control.Maxrss
	}
	// A runner's 512 MiB answer is refused too (ps then shows the shim's
	// state), and the shim's.
	runnerHuge = true
	if out, errOut, ru, err := ps(); err != nil || !strings.Contains(out, " running ") || ru != nil && ru.Maxrss > base+200<<10 {
		t.Fatalf("a runner's 512 MiB answer: %v %q %s %+v", err, out, errOut, ru)
	}
	huge = true
	_, errOut, ru, err := ps()
	if err == nil || !strings.Contains(errOut, "larger than") {
		t.Fatalf("a 512 MiB answer: %v %q", err, errOut)
	}
	if ru != nil {
		t.Logf("FIGURE tandem ps against a 512 MiB answer: peak RSS %d MiB (the control's %d)", ru.Maxrss>>10, base>>10)
		if ru.Maxrss > base+200<<10 { // KiB
			t.Fatalf("tandem peaked at %d MiB", ru.Maxrss>>10)
		}
	}
}
