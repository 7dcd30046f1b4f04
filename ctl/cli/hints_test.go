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
