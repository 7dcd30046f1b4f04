package ctl

import (
	"testing"

	"github.com/tandem-run/tandem/api"
)

// TestDescribeSaysWhy: a run's last line carries its reason or message,
// a multi-node run's dead node included (its status lines may be quiet).
func TestDescribeSaysWhy(t *testing.T) {
	three := 3
	for _, c := range []struct {
		r    Result
		want string
	}{
		{Result{State: api.JobDone}, "job done"},
		{Result{State: api.JobFailed, ExitStatus: &three}, "job failed: exit status 3"},
		{Result{State: api.JobFailed, Message: "node 1 (root@10.0.0.2:22) died: gone; the other nodes were stopped"},
			"job failed: node 1 (root@10.0.0.2:22) died: gone; the other nodes were stopped"},
		{Result{State: api.JobFailed}, "job failed"},
	} {
		if got := Describe(c.r); got != c.want {
			t.Errorf("Describe(%+v) = %q, want %q", c.r, got, c.want)
		}
	}
}
