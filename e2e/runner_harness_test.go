package e2e

import (
	"bytes"
	"context"
	"io"
	"net"

	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/runnerclient"
	"github.com/tandem-run/tandem/e2e/testenv"
)

type runnerHarness struct {
	t         *testing.T
	container string
	tempDir   string
	client    *runnerclient.Client
	sshPort   string
}

// startRunner runs the static runner as the entrypoint of a container of
// image (host network, under docker's init like the shim does).
func startRunner(t *testing.T, image string) *runnerHarness {
	t.Helper()
	return startRunnerWith(t, image)
}

// startRunnerWith passes extra arguments to `dstack-runner start`.
func startRunnerWith(t *testing.T, image string, extra ...string) *runnerHarness {
	t.Helper()
	return startRunnerDocker(t, image, nil, extra...)
}

// startRunnerDocker also passes flags to `docker run` (limits, ...).
func startRunnerDocker(t *testing.T, image string, dockerFlags []string, extra ...string) *runnerHarness {
	t.Helper()
	bins := testenv.Binaries(t)
	_, port, _ := net.SplitHostPort(testenv.FreeAddr(t))
	_, sshPort, _ := net.SplitHostPort(testenv.FreeAddr(t))
	tmp := t.TempDir()
	name := randomID("runner")
	ctx := context.Background()
	args := []string{"run", "-d", "--init", "--name", name, "--network", "host",
		"-v", bins.Runner + ":/usr/local/bin/dstack-runner:ro", "-v", tmp + ":/tmp/runner"}
	args = append(args, dockerFlags...)
	args = append(args, "--entrypoint", "/usr/local/bin/dstack-runner", image,
		"--log-level", "debug", "start", "--temp-dir", "/tmp/runner", "--http-port", port, "--http-address", "127.0.0.1",
		"--logs-wait", "20s", "--ssh-port", sshPort)
	_, err := testenv.Docker(ctx, append(args, extra...)...)
	if err != nil {
		t.Fatal(err)
	}
	h := &runnerHarness{t: t, container: name, tempDir: tmp, sshPort: sshPort}
	t.Cleanup(func() {
		if t.Failed() {
			out, _ := testenv.Docker(context.Background(), "logs", "--tail", "40", name)
			t.Logf("runner container output:\n%s", out)
		}
		_, _ = testenv.Docker(context.Background(), "rm", "-f", name)
	})
	h.client, err = runnerclient.New("127.0.0.1:" + port)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		if hc, err := h.client.Healthcheck(ctx); err == nil && hc.Service == "dstack-runner" {
			return h
		}
		if time.Now().After(deadline) {
			out, _ := testenv.Docker(ctx, "logs", name)
			t.Fatalf("runner did not answer:\n%s", out)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func str(s string) *string { return &s }

// job builds a submit body the way the dstack server does.
func job(commands ...string) api.SubmitBody {
	return api.SubmitBody{
		Run: api.Run{ID: "run-1", RunSpec: api.RunSpec{RunName: "e2e-run", RepoID: "repo-1", RepoData: &api.RepoData{RepoType: api.RepoVirtual}}},
		JobSpec: api.JobSpec{JobsPerReplica: 1, Commands: commands, Env: map[string]string{"FROM_SPEC": "yes"},
			RepoDir: str("/workflow"), RepoData: &api.RepoData{RepoType: api.RepoVirtual}},
		JobSubmission: api.JobSubmission{ID: "job-1"},
		ClusterInfo:   api.ClusterInfo{JobIPs: []string{"10.0.0.1"}, MasterJobIP: "10.0.0.1"},
		Secrets:       map[string]string{},
	}
}

// start submits and runs.
func (h *runnerHarness) start(b api.SubmitBody) api.RunResponse {
	h.t.Helper()
	ctx := context.Background()
	if err := h.client.Submit(ctx, b); err != nil {
		h.t.Fatalf("submit: %v", err)
	}
	rr, ok, err := h.client.Run(ctx)
	if err != nil || !ok {
		h.t.Fatalf("run: %+v %v %v", rr, ok, err)
	}
	return rr
}

type collected struct {
	states  []api.JobStateEvent
	logs    bytes.Buffer
	runner  bytes.Buffer
	pulls   int
	lastTS  int64
	maxResp int
}

// pullUntilDone pulls like the server (timestamp = last_updated) until the
// job has a terminal state and nothing more is pending.
func (h *runnerHarness) pullUntilDone(timeout time.Duration, onEach func(*collected)) *collected {
	h.t.Helper()
	c := &collected{}
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		p, err := h.client.Pull(context.Background(), c.lastTS)
		if err != nil {
			h.t.Fatalf("pull: %v", err)
		}
		c.pulls++
		size := 0
		for _, l := range p.JobLogs {
			if l.Timestamp <= c.lastTS {
				h.t.Fatalf("event %d not after the pull timestamp %d", l.Timestamp, c.lastTS)
			}
			c.logs.Write(l.Message)
			size += len(l.Message)
		}
		for _, l := range p.RunnerLogs {
			c.runner.Write(l.Message)
		}
		c.maxResp = max(c.maxResp, size)
		c.states = append(c.states, p.JobStates...)
		c.lastTS = p.LastUpdated
		if onEach != nil {
			onEach(c)
		}
		if n := len(c.states); n > 0 && c.states[n-1].State.Final() && !p.HasMore {
			return c
		}
		if len(p.JobLogs) == 0 {
			time.Sleep(50 * time.Millisecond)
		}
	}
	h.t.Fatalf("job did not finish in %s; states %+v; logs tail %q", timeout, c.states, tailStr(c.logs.String(), 300))
	return nil
}

func tailStr(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

func (c *collected) final() api.JobStateEvent { return c.states[len(c.states)-1] }

// exitCode waits for the runner container to exit and returns its status.
func (h *runnerHarness) exitCode(timeout time.Duration) string {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	out, err := testenv.Docker(ctx, "wait", h.container)
	if err != nil {
		h.t.Fatalf("runner did not exit: %v", err)
	}
	return strings.TrimSpace(out)
}

func readAllWS(t *testing.T, h *runnerHarness, since time.Time) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ls, err := h.client.Logs(ctx, since)
	if err != nil {
		t.Fatal(err)
	}
	defer ls.Close()
	var buf bytes.Buffer
	for {
		b, err := ls.Next()
		if err == io.EOF {
			return buf.String()
		}
		if err != nil {
			t.Fatalf("ws: %v", err)
		}
		buf.Write(b)
	}
}
