package ctl

import (
	"testing"

	"github.com/tandem-run/tandem/api"
)

func TestResultExitCodeAndDescribe(t *testing.T) {
	seven := 7
	tests := []struct {
		r    Result
		code int
		desc string
	}{
		{Result{State: api.JobDone}, 0, "job done"},
		{Result{State: api.JobFailed, ExitStatus: &seven}, 7, "job failed: exit status 7"},
		{Result{State: api.JobTerminated, Reason: api.ReasonMaxDurationExceeded, Message: "Max duration exceeded"}, 130,
			"job terminated: max_duration_exceeded: Max duration exceeded"},
		{Result{State: api.JobFailed, Reason: api.ReasonExecutorError}, 1, "job failed: executor_error"},
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
