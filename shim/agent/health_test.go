package agent

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/docker/docker/client"

	"github.com/tandem-run/tandem/api"
)

func TestInstanceHealth(t *testing.T) {
	// The error the Docker client gives when nothing listens on its socket.
	c, err := client.NewClientWithOpts(client.WithHost("unix://" + t.TempDir() + "/docker.sock"))
	if err != nil {
		t.Fatal(err)
	}
	_, noDaemon := c.Ping(context.Background())
	if noDaemon == nil {
		t.Fatal("ping of a missing socket succeeded")
	}
	gpuFail := &api.DCGMHealth{OverallHealth: 10, Incidents: []api.DCGMIncident{{Health: 10, ErrorMessage: "GPU 0: xid 79"}}}
	for _, tc := range []struct {
		name      string
		docker    error
		gpus      *api.DCGMHealth
		runner    api.ComponentStatus
		overall   int
		first     string // the message the dstack server shows
		incidents int
	}{
		{name: "healthy without GPUs is null", overall: -1},
		{name: "healthy with GPUs passes GPU health", gpus: gpuFail, overall: 10, first: "GPU 0: xid 79", incidents: 1},
		{name: "no daemon", docker: noDaemon, overall: api.HealthFail, first: "Docker is not running on this host", incidents: 1},
		{name: "no daemon, GPU incident follows", docker: noDaemon, gpus: gpuFail, overall: api.HealthFail, first: "apt-get install -y docker.io", incidents: 2},
		{name: "daemon errs", docker: errors.New("docker ping: 500 boom"), overall: api.HealthFail, first: "Docker does not answer", incidents: 1},
		{name: "no runner", runner: api.ComponentNotInstalled, overall: api.HealthFail, first: "no dstack-runner at /opt/r, so no task can start: start dstack-shim with --runner-binary-path", incidents: 1},
		{name: "no runner, GPU incident follows", runner: api.ComponentNotInstalled, gpus: gpuFail, overall: api.HealthFail, first: "no dstack-runner", incidents: 2},
		{name: "no daemon and no runner", docker: noDaemon, runner: api.ComponentNotInstalled, overall: api.HealthFail, first: "Docker is not running", incidents: 2},
		{name: "runner being installed", runner: api.ComponentInstalling, overall: -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := instanceHealth{docker: func(context.Context) error { return tc.docker }}
			if tc.runner != "" {
				h.runner = func(context.Context) string { return runnerProblem(tc.runner, "/opt/r") }
			}
			if tc.gpus != nil {
				h.gpus = func(context.Context) *api.DCGMHealth { return tc.gpus }
			}
			got := h.check(context.Background())
			if tc.overall < 0 {
				if got != nil {
					t.Fatalf("want null, got %+v", got)
				}
				return
			}
			if got == nil || got.OverallHealth != tc.overall || len(got.Incidents) != tc.incidents {
				t.Fatalf("got %+v", got)
			}
			if !strings.Contains(got.Incidents[0].ErrorMessage, tc.first) {
				t.Fatalf("first incident %q lacks %q", got.Incidents[0].ErrorMessage, tc.first)
			}
			for _, in := range got.Incidents {
				if in.Health != api.HealthPass && in.Health != api.HealthWarn && in.Health != api.HealthFail {
					t.Fatalf("the dstack server rejects health %d", in.Health)
				}
			}
		})
	}
}
