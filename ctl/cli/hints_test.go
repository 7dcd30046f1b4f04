package cli

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/ctl"
)

func TestErrTextAddsTheFlag(t *testing.T) {
	// Every hint the library has is said in this CLI's words.
	for h := ctl.HintRunnerPort; h <= ctl.HintBinaries; h++ {
		if hints[h] == "" {
			t.Errorf("hint %d has no text", h)
		}
	}
	err := fmt.Errorf("logs: %w", &ctl.HintError{Hint: ctl.HintRunnerPort, Err: errors.New("runner of task x at h:1: refused")})
	if got := errText(err); !strings.HasPrefix(got, "logs: runner of task x") || !strings.HasSuffix(got, "give --runner-port)") {
		t.Fatalf("errText = %q", got)
	}
	if got := errText(errors.New("plain")); got != "plain" {
		t.Fatalf("an error without a hint: %q", got)
	}
	unauth := fmt.Errorf("list tasks: %w", &api.StatusError{Method: "GET", Path: "/api/tasks", Code: 401, Message: "a valid bearer token is required"})
	if got := errText(unauth); !strings.HasSuffix(got, "give it with --shim-token or TANDEM_SHIM_API_TOKEN") {
		t.Fatalf("a shim's 401: %q", got)
	}
}

// An error is printed with the control characters of its lines escaped:
// it may carry a hostile shim's words (a task named with a terminal's
// escape sequence); its line breaks and already escaped text stay.
func TestErrTextIsPrintable(t *testing.T) {
	err := &ctl.HintError{Hint: ctl.HintBridgeNetwork, Err: errors.New("task \x1b]0;owned\x07 runs on the host network\nsecond \\x1b line")}
	got := errText(err)
	if strings.ContainsAny(got, "\x1b\x07") || !strings.Contains(got, `task \x1b]0;owned\x07 runs`) || !strings.Contains(got, "\nsecond \\x1b line\nuse --network bridge") {
		t.Fatalf("errText = %q", got)
	}
}

// An address that answers HTTP, but not as a shim (a wrong port, a proxy
// that answers for every address), is said to be that, not unreachable.
func TestErrTextSaysNoShimIsThere(t *testing.T) {
	hc := ctl.ShimUnreached("10.0.0.9:10998", &api.StatusError{Method: "GET", Path: "/api/healthcheck", Code: 404})
	got := errText(hc)
	if strings.Contains(got, "not reachable") || !strings.Contains(got, "the server at 10.0.0.9:10998 answered no healthcheck: GET /api/healthcheck: 404: Not Found\nno dstack-shim serves that address: check its host and port (--shim; dstack's shim listens on 10998)") {
		t.Fatalf("a 404 to the healthcheck: %q", got)
	}
	list := fmt.Errorf("list tasks: %w", &api.StatusError{Method: "GET", Path: "/api/tasks", Code: 404})
	if got := errText(list); !strings.Contains(got, "\nthe server there keeps no tasks: not a dstack-shim") {
		t.Fatalf("a 404 to the task list: %q", got)
	}
	// A task the shim does not have is no wrong address.
	one := fmt.Errorf("get task: %w", &api.StatusError{Method: "GET", Path: "/api/tasks/abc", Code: 404})
	if got := errText(one); strings.Contains(got, "\n") {
		t.Fatalf("a 404 for one task: %q", got)
	}
	down := ctl.ShimUnreached("127.0.0.1:1", errors.New("dial tcp 127.0.0.1:1: connect: connection refused"))
	if got := errText(down); !strings.HasPrefix(got, "shim at 127.0.0.1:1 is not reachable (dial tcp") {
		t.Fatalf("no answer at all: %q", got)
	}
}
