package e2e

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/shimclient"
	"github.com/tandem-run/tandem/e2e/testenv"
	"github.com/tandem-run/tandem/shim/task"
)

// runnerScript makes a stand-in for dstack-runner: a shell script that the
// shim probes and bind-mounts like the real one, running body in the task
// container. Shim behaviour does not depend on what the runner does.
func runnerScript(t testing.TB, body string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "dstack-runner")
	script := "#!/bin/sh\nif [ \"$1\" = \"--version\" ]; then echo \"dstack-runner version 0.0.0+stand.in\"; exit 0; fi\n" + body + "\n"
	if err := os.WriteFile(path, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return path
}

type shimHarness struct {
	t      testing.TB
	cmd    *exec.Cmd
	exited chan error
	home   string
	log    string // the shim's stderr
	runner string
	image  string
	client *shimclient.Client
	names  []string
}

// startShim runs the real dstack-shim binary with a temporary home.
func startShim(t *testing.T, runner string, env []string, args ...string) *shimHarness {
	t.Helper()
	return startShimTB(t, runner, env, args...)
}

// startShimB starts a shim for a benchmark with a stand-in runner body.
func startShimB(b *testing.B, body string, args ...string) *shimHarness {
	b.Helper()
	return startShimTB(b, runnerScript(b, body), nil, args...)
}

func startShimTB(t testing.TB, runner string, env []string, args ...string) *shimHarness {
	t.Helper()
	bins := testenv.Binaries(t)
	img := testenv.Busybox(t)
	home := t.TempDir()
	testenv.UnmountUnder(t, home)
	_, port, _ := net.SplitHostPort(testenv.FreeAddr(t))
	argv := append([]string{"--shim-home", home, "--state-spill-dir", t.TempDir(), "--shim-http-port", port, "--runner-binary-path", runner, "--shim-log-level", "debug"}, args...)
	cmd := exec.Command(bins.Shim, argv...)
	cmd.Env = append(os.Environ(), env...)
	logf, err := os.Create(filepath.Join(t.TempDir(), "stderr"))
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	testenv.Isolate(cmd)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c, err := shimclient.New("127.0.0.1:" + port)
	if err != nil {
		t.Fatal(err)
	}
	h := &shimHarness{t: t, runner: runner, cmd: cmd, exited: make(chan error, 1), home: home, log: logf.Name(), image: img, client: c}
	go func() { h.exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		logf.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		for _, n := range h.names {
			_, _ = testenv.Docker(ctx, "rm", "-f", "-v", n)
		}
		if t.Failed() {
			b, _ := os.ReadFile(logf.Name())
			t.Logf("shim log:\n%s", b)
		}
	})
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := c.Healthcheck(context.Background()); err == nil {
			return h
		}
		select {
		case err := <-h.exited:
			b, _ := os.ReadFile(logf.Name())
			t.Fatalf("shim exited at start: %v\n%s", err, b)
		default:
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(logf.Name())
			t.Fatalf("shim did not answer: %s", b)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// addr is the shim's host:port.
func (h *shimHarness) addr() string {
	return strings.TrimSuffix(strings.TrimPrefix(h.client.BaseURL(), "http://"), "/")
}

func randomID(prefix string) string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return prefix + "-" + hex.EncodeToString(b)
}

// submit fills id, name and image when empty and submits.
func (h *shimHarness) submit(cfg api.TaskConfig) api.TaskConfig {
	h.t.Helper()
	if cfg.ID == "" {
		cfg.ID = randomID("task")
	}
	if cfg.Name == "" {
		cfg.Name = randomID("e2e")
	}
	if cfg.ImageName == "" {
		cfg.ImageName = h.image
	}
	h.names = append(h.names, task.ContainerName(cfg.Name, cfg.ID))
	if err := h.client.SubmitTask(context.Background(), cfg); err != nil {
		h.t.Fatalf("submit: %v", err)
	}
	return cfg
}

// wait polls the task until ok or the timeout.
func (h *shimHarness) wait(id string, timeout time.Duration, ok func(api.TaskInfoResponse) bool) api.TaskInfoResponse {
	h.t.Helper()
	deadline := time.Now().Add(timeout)
	var last api.TaskInfoResponse
	for time.Now().Before(deadline) {
		info, err := h.client.GetTask(context.Background(), id)
		if err != nil {
			h.t.Fatalf("get task: %v", err)
		}
		last = info
		if ok(info) {
			return info
		}
		time.Sleep(25 * time.Millisecond)
	}
	h.t.Fatalf("task %s: condition not reached in %s; last: %+v", id, timeout, last)
	return last
}

func terminated(i api.TaskInfoResponse) bool { return i.Status == api.TaskTerminated }
func running(i api.TaskInfoResponse) bool    { return i.Status == api.TaskRunning }

func (h *shimHarness) terminate(id string, reason api.TerminationReason, msg string, timeout uint) api.TaskInfoResponse {
	h.t.Helper()
	info, err := h.client.TerminateTask(context.Background(), id, api.TaskTerminateRequest{TerminationReason: reason, TerminationMessage: msg, Timeout: timeout})
	if err != nil {
		h.t.Fatalf("terminate: %v", err)
	}
	return info
}

func containerExists(t *testing.T, nameOrID string) bool {
	t.Helper()
	_, err := testenv.Docker(context.Background(), "inspect", "--format", "{{.Id}}", nameOrID)
	return err == nil
}

// uniqueImage builds an image with a fresh random layer of size bytes, so a
// pull of it must download that layer.
func uniqueImage(t *testing.T, size int) string {
	t.Helper()
	blob := make([]byte, size)
	_, _ = rand.Read(blob)
	return buildImage(t, "unique", map[string][]byte{"blob": blob,
		"Dockerfile": fmt.Appendf(nil, "FROM %s\nCOPY blob /blob\n", testenv.Busybox(t))})
}

// buildImage builds files (a Dockerfile and what it copies) as
// tandem-test/<repo>:<random>, removed when the test ends, and returns
// the tag.
func buildImage(t *testing.T, repo string, files map[string][]byte) string {
	t.Helper()
	dir := t.TempDir()
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	tag := "tandem-test/" + repo + ":" + strings.ToLower(randomID("i"))
	if _, err := testenv.Docker(context.Background(), "build", "-q", "-t", tag, dir); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = testenv.Docker(context.Background(), "rmi", "-f", tag) })
	return tag
}

// hostUser returns the home of the test's host user (created once), whose
// authorized_keys host-key tests watch. Needs root; CI runs as root.
func hostUser(t *testing.T, name string) string {
	t.Helper()
	if os.Geteuid() != 0 {
		if testenv.InCI() {
			t.Fatal("CI runs as root")
		}
		t.Skip("needs root to create a host user")
	}
	if _, err := user.Lookup(name); err != nil {
		if out, err := exec.Command("useradd", "-m", "-s", "/bin/sh", name).CombinedOutput(); err != nil {
			t.Fatalf("useradd: %v %s", err, out)
		}
	}
	u, err := user.Lookup(name)
	if err != nil {
		t.Fatal(err)
	}
	return u.HomeDir
}
