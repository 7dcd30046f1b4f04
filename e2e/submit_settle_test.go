package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/e2e/testenv"
	"github.com/tandem-run/tandem/shim/task"
)

// postSubmit submits cfg as dstack's server does and returns the answer's
// body and how long it took.
func postSubmit(t *testing.T, h *shimHarness, cfg api.TaskConfig) (api.TaskSubmitResponse, time.Duration) {
	t.Helper()
	h.names = append(h.names, task.ContainerName(cfg.Name, cfg.ID))
	body, _ := json.Marshal(cfg)
	began := time.Now()
	resp, err := http.Post(h.client.BaseURL()+"/api/tasks", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	took := time.Since(began)
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("submit: %d %s", resp.StatusCode, b)
	}
	var r api.TaskSubmitResponse
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatalf("submit answer %q: %v", b, err)
	}
	return r, took
}

// TestSubmitAnswersOnceRunning: a submit whose image is here is answered
// once its task runs, so dstack's server starts the job on its first look
// (10-160 ms after the submit) rather than on the next, 5-10 s later. One
// that needs a registry pull is answered when the pull begins, within the
// bound however slow the registry; --submit-wait 0 answers at once, as
// dstack's shim does.
func TestSubmitAnswersOnceRunning(t *testing.T) {
	t.Parallel()
	reg := testenv.StartRegistry(t)
	reg.Push(t, uniqueImage(t, 64<<10), "tandem/held:v1")
	gateAddr, release := blobGate(t, reg.Addr)
	defer release()
	h := startShim(t, runnerScript(t, `sleep 120`), nil)

	cfg := api.TaskConfig{ID: randomID("settle"), Name: randomID("e2e"), ImageName: h.image}
	r, took := postSubmit(t, h, cfg)
	if r.Status != api.TaskRunning || r.ContainerID == "" {
		t.Fatalf("a task whose image is here: want running with its container, have %+v (after %s)", r, took)
	}
	t.Logf("submit of a present image answered running in %s", took.Round(time.Millisecond))
	h.terminate(cfg.ID, api.ReasonTerminatedByUser, "", 0)

	held := api.TaskConfig{ID: randomID("settle"), Name: randomID("e2e"), ImageName: gateAddr + "/tandem/held:v1", RegistryUsername: reg.Username, RegistryPassword: reg.Password}
	r, took = postSubmit(t, h, held)
	if r.Status != api.TaskPulling || took >= task.Defaults().PullStallTimeout {
		t.Fatalf("a task whose registry holds its blobs: want pulling at once, have %+v after %s", r, took)
	}
	if took >= 3*time.Second {
		t.Fatalf("a submit waited %s on the registry (bound: the 3 s default)", took)
	}
	h.terminate(held.ID, api.ReasonTerminatedByUser, "", 0)

	h0 := startShim(t, runnerScript(t, `sleep 120`), nil, "--submit-wait", "0")
	cfg = api.TaskConfig{ID: randomID("settle"), Name: randomID("e2e"), ImageName: h0.image}
	r, _ = postSubmit(t, h0, cfg)
	if r.Status != api.TaskPending {
		t.Fatalf("--submit-wait 0: want the answer at once (pending), have %+v", r)
	}
	h0.wait(cfg.ID, time.Minute, running)
	_, _ = h0.client.TerminateTask(context.Background(), cfg.ID, api.TaskTerminateRequest{})
}
