package agent

import (
	"context"
	"fmt"
	"time"

	"github.com/docker/docker/client"

	"github.com/tandem-run/tandem/api"
)

// dockerPingTimeout bounds the Docker check of one health request.
const dockerPingTimeout = 5 * time.Second

// instanceHealth answers /api/instance/health in DCGM's shape, the only
// health the dstack server reads: a Docker that does not answer, or no
// runner binary, makes the instance a failure whose first incident (the
// message the server shows) says why and how to fix it; GPU health, where
// there is any, follows. With neither a problem nor GPUs it is null, as
// dstack's shim answers.
type instanceHealth struct {
	docker func(context.Context) error           // Docker's ping
	gpus   func(context.Context) *api.DCGMHealth // nil without NVIDIA GPUs
	// runner says what is wrong with the runner binary ("" when nothing
	// is; nil: not checked).
	runner func(context.Context) string
}

func (h instanceHealth) check(ctx context.Context) *api.DCGMHealth {
	var g *api.DCGMHealth
	if h.gpus != nil {
		g = h.gpus(ctx)
	}
	var problems []api.DCGMIncident
	if h.docker != nil {
		pctx, cancel := context.WithTimeout(ctx, dockerPingTimeout)
		err := h.docker(pctx)
		cancel()
		if err != nil {
			problems = append(problems, api.DCGMIncident{Health: api.HealthFail, ErrorMessage: dockerProblem(err)})
		}
	}
	if h.runner != nil {
		if msg := h.runner(ctx); msg != "" {
			problems = append(problems, api.DCGMIncident{Health: api.HealthFail, ErrorMessage: msg})
		}
	}
	if len(problems) == 0 {
		return g
	}
	out := &api.DCGMHealth{OverallHealth: api.HealthFail, Incidents: problems}
	if g != nil {
		out.Incidents = append(out.Incidents, g.Incidents...)
	}
	return out
}

// runnerProblem is the incident of a runner binary that is not there
// (status as its component manager reads it at path): no task can start.
// One being installed is no problem yet; one that does not answer as
// dstack-runner stops the shim at its start (startComponents).
func runnerProblem(status api.ComponentStatus, path string) string {
	if status != api.ComponentNotInstalled {
		return ""
	}
	return fmt.Sprintf("no dstack-runner at %s, so no task can start: start dstack-shim with --runner-binary-path PATH (a build's bin/dstack-runner), or install one (POST /api/components/install)", path)
}

// dockerProblem is the incident's message: what is wrong and the fix.
func dockerProblem(err error) string {
	if client.IsErrConnectionFailed(err) {
		return fmt.Sprintf("Docker is not running on this host, so no task can start (%v). Install and start it: apt-get install -y docker.io && systemctl enable --now docker (or render the cloud-init payload with tandem cloudinit --install-docker)", err)
	}
	return fmt.Sprintf("Docker does not answer, so no task can start: %v. Check it with systemctl status docker and journalctl -u docker", err)
}
