package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/e2e/testenv"
)

func TestShimHostModeExitZeroThenRemove(t *testing.T) {
	t.Parallel()
	h := startShim(t, runnerScript(t, `echo "args: $*"; exit 0`), nil)
	cfg := h.submit(api.TaskConfig{})
	info := h.wait(cfg.ID, time.Minute, terminated)
	if info.TerminationReason != api.ReasonDoneByRunner || info.TerminationMessage != "" {
		t.Fatalf("exit 0: %+v", info)
	}
	if info.Ports == nil || len(info.Ports) != 0 || info.GPUIDs == nil || len(info.GPUIDs) != 0 {
		t.Fatalf("host mode reports ports [] and gpus_ids []: %+v", info)
	}
	logs, err := testenv.Docker(context.Background(), "logs", info.ContainerID)
	if err != nil {
		t.Fatal(err)
	}
	// The runner gets dstack's command line; host mode binds its API to localhost.
	want := "args: --log-level info start --temp-dir /tmp/runner --http-port 10999 --ssh-port 10022 --http-address localhost"
	if strings.TrimSpace(logs) != want {
		t.Fatalf("runner command line:\n got %q\nwant %q", strings.TrimSpace(logs), want)
	}
	runnerDir := filepath.Join(h.home, "runners", info.ContainerName)
	if _, err := os.Stat(runnerDir); err != nil {
		t.Fatalf("runner dir: %v", err)
	}
	items, err := h.client.ListTasks(context.Background())
	if err != nil || len(items) != 1 || items[0].Status != api.TaskTerminated {
		t.Fatalf("list: %+v %v", items, err)
	}
	if err := h.client.RemoveTask(context.Background(), cfg.ID); err != nil {
		t.Fatal(err)
	}
	if containerExists(t, info.ContainerID) {
		t.Fatal("remove must delete the container")
	}
	if _, err := os.Stat(runnerDir); !os.IsNotExist(err) {
		t.Fatalf("remove must delete the runner dir: %v", err)
	}
	if _, err := h.client.GetTask(context.Background(), cfg.ID); !errors.Is(err, api.ErrNotFound) {
		t.Fatalf("removed task: %v", err)
	}
}

func TestShimExitNonZeroReportsLastLines(t *testing.T) {
	t.Parallel()
	h := startShim(t, runnerScript(t, `for i in 1 2 3 4 5 6; do echo "line $i"; done; sleep 0.3; echo "line 7 on stderr" >&2; exit 3`), nil)
	cfg := h.submit(api.TaskConfig{})
	info := h.wait(cfg.ID, time.Minute, terminated)
	if info.TerminationReason != api.ReasonContainerExitedWithError {
		t.Fatalf("reason %q", info.TerminationReason)
	}
	if want := "line 3\nline 4\nline 5\nline 6\nline 7 on stderr"; info.TerminationMessage != want {
		t.Fatalf("message %q, want the last 5 lines %q", info.TerminationMessage, want)
	}
}

func TestShimBridgePortsReachableAndGracefulTerminate(t *testing.T) {
	t.Parallel()
	h := startShim(t, runnerScript(t, `mkdir -p /tmp/www && echo "runner api" > /tmp/www/index.html && exec httpd -f -p 10999 -h /tmp/www`), nil)
	cfg := h.submit(api.TaskConfig{NetworkMode: "bridge"})
	info := h.wait(cfg.ID, time.Minute, running)
	hostPort := map[int]int{}
	for _, p := range info.Ports {
		hostPort[p.Container] = p.Host
	}
	if len(info.Ports) != 2 || hostPort[10999] == 0 || hostPort[10022] == 0 {
		t.Fatalf("bridge ports: %+v", info.Ports)
	}
	var body string
	for i := 0; i < 50; i++ {
		resp, err := http.Get("http://127.0.0.1:" + strconv.Itoa(hostPort[10999]) + "/")
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			body = string(b)
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if body != "runner api\n" {
		t.Fatalf("runner port not reachable through the published port: %q", body)
	}
	// The runner exits on SIGTERM: a 30 s grace must end as soon as it does.
	start := time.Now()
	info = h.terminate(cfg.ID, api.ReasonTerminatedByUser, "stopped by user", 30)
	if took := time.Since(start); took > 15*time.Second {
		t.Fatalf("terminate waited %s: SIGTERM did not reach the runner", took)
	}
	if info.Status != api.TaskTerminated || info.TerminationReason != api.ReasonTerminatedByUser || info.TerminationMessage != "stopped by user" {
		t.Fatalf("after terminate: %+v", info)
	}
	// A second terminate keeps the first reason.
	info = h.terminate(cfg.ID, api.ReasonTerminatedByServer, "again", 0)
	if info.TerminationReason != api.ReasonTerminatedByUser || info.TerminationMessage != "stopped by user" {
		t.Fatalf("first reason must win: %+v", info)
	}
}

func TestShimTerminateWithoutGraceKillsAtOnce(t *testing.T) {
	t.Parallel()
	h := startShim(t, runnerScript(t, `trap '' TERM INT; while :; do sleep 1; done`), nil)
	cfg := h.submit(api.TaskConfig{})
	info := h.wait(cfg.ID, time.Minute, running)
	// Remove before terminate is refused.
	err := h.client.RemoveTask(context.Background(), cfg.ID)
	var se *api.StatusError
	if !errors.As(err, &se) || se.Code != 409 || se.Message != "request error: cannot remove task "+cfg.ID+" with running status" {
		t.Fatalf("remove of a running task: %v", err)
	}
	start := time.Now()
	info = h.terminate(cfg.ID, api.ReasonMaxDurationExceeded, "", 0)
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("timeout=0 must kill right away, took %s", took)
	}
	if info.TerminationReason != api.ReasonMaxDurationExceeded {
		t.Fatalf("%+v", info)
	}
	state, err := testenv.Docker(context.Background(), "inspect", "--format", "{{.State.Status}}", info.ContainerID)
	if err != nil || strings.TrimSpace(state) != "exited" {
		t.Fatalf("container state %q %v", state, err)
	}
	// Concurrent terminate and remove of the same task neither crash the shim
	// nor fail: they queue on the task.
	var wg sync.WaitGroup
	errs := make(chan error, 6)
	for i := 0; i < 3; i++ {
		wg.Add(2)
		go func() {
			defer wg.Done()
			_, err := h.client.TerminateTask(context.Background(), cfg.ID, api.TaskTerminateRequest{})
			if err != nil && !errors.Is(err, api.ErrNotFound) {
				errs <- err
			}
		}()
		go func() {
			defer wg.Done()
			if err := h.client.RemoveTask(context.Background(), cfg.ID); err != nil && !errors.Is(err, api.ErrNotFound) {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("concurrent terminate/remove: %v", err)
	}
	if _, err := h.client.Healthcheck(context.Background()); err != nil {
		t.Fatalf("shim died: %v", err)
	}
	if containerExists(t, info.ContainerID) {
		t.Fatal("container left behind")
	}
}

func TestShimSubmitValidationAndIdempotency(t *testing.T) {
	t.Parallel()
	h := startShim(t, runnerScript(t, `while :; do sleep 1; done`), nil)
	cfg := h.submit(api.TaskConfig{})
	ctx := context.Background()
	if err := h.client.SubmitTask(ctx, cfg); err != nil {
		t.Fatalf("identical re-submit must be idempotent: %v", err)
	}
	changed := cfg
	changed.Memory = 1 << 30
	err := h.client.SubmitTask(ctx, changed)
	var se *api.StatusError
	if !errors.As(err, &se) || se.Code != 409 || se.Message != "request error: task "+cfg.ID+" is already submitted" {
		t.Fatalf("different config under the same id: %v", err)
	}
	for _, tc := range []struct {
		cfg  api.TaskConfig
		want string
	}{
		{api.TaskConfig{Name: "n", ImageName: "i"}, "empty id"},
		{api.TaskConfig{ID: "x", ImageName: "i"}, "empty name"},
		{api.TaskConfig{ID: "x", Name: "n"}, "empty image_name"},
		{api.TaskConfig{ID: "x", Name: "n", ImageName: "i", GPU: -2}, "gpu must be -1, 0 or a positive count, got -2"},
	} {
		err := h.client.SubmitTask(ctx, tc.cfg)
		if !errors.As(err, &se) || se.Code != 400 || se.Message != tc.want {
			t.Errorf("submit %+v: %v, want 400 %q", tc.cfg, err, tc.want)
		}
	}
	if _, err := h.client.TerminateTask(ctx, "no-such-task", api.TaskTerminateRequest{}); !errors.Is(err, api.ErrNotFound) {
		t.Fatalf("unknown task: %v", err)
	}
	// Raw bodies: wrong type, unknown reason.
	base := "http://" + strings.TrimPrefix(h.client.BaseURL(), "http://")
	for _, tc := range []struct{ path, body, want string }{
		{"/api/tasks", `{"id":"x","name":"n","image_name":"i","gpu":"two"}`, `Request body contains an invalid value for the "gpu" field (at position 49)`},
		{"/api/tasks/" + cfg.ID + "/terminate", `{"termination_reason":"because"}`, `unknown termination_reason "because"`},
	} {
		resp, err := http.Post(base+tc.path, "application/json", strings.NewReader(tc.body))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 400 || strings.TrimSpace(string(b)) != tc.want {
			t.Errorf("%s %s: %d %q", tc.path, tc.body, resp.StatusCode, b)
		}
	}
	h.terminate(cfg.ID, api.ReasonTerminatedByUser, "", 0)
}

func TestShimLimitsMountsAndEnv(t *testing.T) {
	t.Parallel()
	h := startShim(t, runnerScript(t, `echo written > /data/out.txt; while :; do sleep 1; done`),
		[]string{"http_proxy=http://proxy.internal:3128"})
	hostDir := filepath.Join(t.TempDir(), "not", "yet", "there")
	cfg := h.submit(api.TaskConfig{CPU: 1.5, Memory: 256 << 20, ShmSize: 64 << 20,
		InstanceMounts: []api.InstanceMountPoint{{InstancePath: hostDir, Path: "/data"}}})
	info := h.wait(cfg.ID, time.Minute, running)
	fi, err := os.Stat(hostDir)
	// dstack's server expects a missing path made; 0755 as docker -v makes
	// one (dstack's shim made it 0777: writable by every user of the host).
	if err != nil || fi.Mode().Perm() != 0o755 {
		t.Fatalf("missing instance path must be created 0755: %v %v", fi, err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if b, err := os.ReadFile(filepath.Join(hostDir, "out.txt")); err == nil && string(b) == "written\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("container did not write through the instance mount")
		}
		time.Sleep(50 * time.Millisecond)
	}
	out, err := testenv.Docker(context.Background(), "inspect", info.ContainerID)
	if err != nil {
		t.Fatal(err)
	}
	var ins []struct {
		Config struct {
			Env    []string
			Labels map[string]string
			User   string
		}
		HostConfig struct {
			NanoCpus, Memory, ShmSize int64
			Tmpfs                     map[string]string
			Init                      *bool
			NetworkMode               string
		}
		Mounts []struct {
			Source, Destination string
			RW                  bool
		}
	}
	if err := json.Unmarshal([]byte(out), &ins); err != nil || len(ins) != 1 {
		t.Fatalf("inspect: %v", err)
	}
	c := ins[0]
	if c.HostConfig.NanoCpus != 1_500_000_000 || c.HostConfig.Memory != 256<<20 || c.HostConfig.ShmSize != 64<<20 {
		t.Fatalf("limits: %+v", c.HostConfig)
	}
	if tmpfs := c.HostConfig.Tmpfs["/dev/shm"]; !strings.Contains(tmpfs, "exec") || !strings.Contains(tmpfs, "size="+strconv.Itoa(64<<20)) {
		t.Fatalf("/dev/shm must be an exec tmpfs of shm_size: %q", tmpfs)
	}
	if c.HostConfig.Init == nil || !*c.HostConfig.Init || c.HostConfig.NetworkMode != "host" || c.Config.User != "0" { // root, as uid 0 (engineUser)
		t.Fatalf("init/network/user: %+v %+v", c.HostConfig, c.Config.User)
	}
	if c.Config.Labels["ai.dstack.shim.is-task"] != "true" || c.Config.Labels["ai.dstack.shim.task-id"] != cfg.ID {
		t.Fatalf("labels %v", c.Config.Labels)
	}
	if !contains(c.Config.Env, "http_proxy=http://proxy.internal:3128") {
		t.Fatalf("pass-env not applied: %v", c.Config.Env)
	}
	mounts := map[string]bool{}
	for _, m := range c.Mounts {
		mounts[m.Destination+" rw="+strconv.FormatBool(m.RW)] = true
	}
	for _, want := range []string{"/tmp/runner rw=true", "/usr/local/bin/dstack-runner rw=false", "/data rw=true"} {
		if !mounts[want] {
			t.Fatalf("mount %q missing: %v", want, mounts)
		}
	}
	h.terminate(cfg.ID, api.ReasonTerminatedByUser, "", 0)
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

func TestShimHostSSHKeys(t *testing.T) {
	t.Parallel()
	const username = "tandem-e2e"
	ak := filepath.Join(hostUser(t, username), ".ssh", "authorized_keys")
	_ = os.MkdirAll(filepath.Dir(ak), 0o700)
	const key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE2e2e2e2e2e2e2e2e2e2e2e2e2e2e2e2e2e2e2e2e2e user@laptop"
	if err := os.WriteFile(ak, []byte(key+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	h := startShim(t, runnerScript(t, `sleep 2; exit 0`), nil)
	cfg := h.submit(api.TaskConfig{HostSSHUser: username, HostSSHKeys: []string{key}})
	h.wait(cfg.ID, time.Minute, running)
	b, _ := os.ReadFile(ak)
	if want := key + "\n" + key + " # tandem task " + cfg.ID + "\n"; string(b) != want {
		t.Fatalf("while running:\n%s", b)
	}
	h.wait(cfg.ID, time.Minute, terminated)
	b, _ = os.ReadFile(ak)
	if string(b) != key+"\n" {
		t.Fatalf("after the task only the user's own line stays:\n%s", b)
	}
}

func TestShimRegistryPullWithCredentials(t *testing.T) {
	t.Parallel()
	reg := testenv.StartRegistry(t)
	ref := reg.Push(t, uniqueImage(t, 512<<10), "tandem/private:v1")
	h := startShim(t, runnerScript(t, `test -f /blob && exit 0; exit 9`), nil)

	bad := h.submit(api.TaskConfig{ImageName: ref, RegistryUsername: reg.Username, RegistryPassword: "wrong"})
	info := h.wait(bad.ID, 2*time.Minute, terminated)
	if info.TerminationReason != api.ReasonCreatingContainerError || !strings.HasPrefix(info.TerminationMessage, "pullImage error:") ||
		!(strings.Contains(info.TerminationMessage, "unauthorized") || strings.Contains(info.TerminationMessage, "authentication required")) {
		t.Fatalf("wrong password: %+v", info)
	}

	good := h.submit(api.TaskConfig{ImageName: ref, RegistryUsername: reg.Username, RegistryPassword: reg.Password})
	info = h.wait(good.ID, 2*time.Minute, terminated)
	if info.TerminationReason != api.ReasonDoneByRunner {
		t.Fatalf("pull with credentials: %+v", info)
	}
	p := info.ImagePullProgress
	if p == nil || p.TotalBytes <= 0 || p.DownloadedBytes != p.TotalBytes || !p.IsTotalBytesFinal {
		t.Fatalf("pull progress: %+v", p)
	}
	log, err := os.ReadFile(filepath.Join(h.home, "runners", info.ContainerName, "pull.log"))
	if err != nil || !strings.Contains(string(log), "Pull complete") {
		t.Fatalf("pull.log: %v %q", err, log)
	}
}

// blobGate is a proxy in front of a registry that holds blob downloads
// until released, to make a pull hang mid-way.
func blobGate(t *testing.T, upstream string) (addr string, release func()) {
	t.Helper()
	u, _ := url.Parse("http://" + upstream)
	proxy := httputil.NewSingleHostReverseProxy(u)
	gate := make(chan struct{})
	var once sync.Once
	release = func() { once.Do(func() { close(gate) }) }
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet && strings.Contains(r.URL.Path, "/blobs/") && !strings.HasSuffix(r.URL.Path, "/") {
			select {
			case <-gate:
			case <-r.Context().Done():
				return
			}
		}
		proxy.ServeHTTP(w, r)
	})}
	addr = testenv.FreeAddr(t)
	testenv.RemoveImagesFrom(t, addr)
	ln, err := netListen(addr)
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { release(); _ = srv.Close() })
	return addr, release
}

func TestShimPullCancelOnTerminateAndStallTimeout(t *testing.T) {
	t.Parallel()
	reg := testenv.StartRegistry(t)
	reg.Push(t, uniqueImage(t, 256<<10), "tandem/slow:v1")
	reg.Push(t, uniqueImage(t, 256<<10), "tandem/stall:v1")
	gateAddr, _ := blobGate(t, reg.Addr)

	h := startShim(t, runnerScript(t, `exit 0`), nil, "--pull-stall-timeout", "3s")
	slow := h.submit(api.TaskConfig{ImageName: gateAddr + "/tandem/slow:v1", RegistryUsername: reg.Username, RegistryPassword: reg.Password})
	h.wait(slow.ID, time.Minute, func(i api.TaskInfoResponse) bool { return i.Status == api.TaskPulling })
	time.Sleep(300 * time.Millisecond)
	start := time.Now()
	info := h.terminate(slow.ID, api.ReasonTerminatedByUser, "cancelled while pulling", 0)
	if took := time.Since(start); took > 5*time.Second || info.Status != api.TaskTerminated || info.TerminationReason != api.ReasonTerminatedByUser {
		t.Fatalf("terminate during pull (took %s): %+v", took, info)
	}

	stall := h.submit(api.TaskConfig{ImageName: gateAddr + "/tandem/stall:v1", RegistryUsername: reg.Username, RegistryPassword: reg.Password})
	info = h.wait(stall.ID, time.Minute, terminated)
	if info.TerminationReason != api.ReasonCreatingContainerError || !strings.Contains(info.TerminationMessage, "no progress for") {
		t.Fatalf("stalled pull: %+v", info)
	}
}
