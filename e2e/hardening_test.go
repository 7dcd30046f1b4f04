package e2e

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/e2e/testenv"
	"github.com/tandem-run/tandem/internal/loopdev"
	"github.com/tandem-run/tandem/internal/sparsetar"
)

// Issue 13's repros, each against the real binaries.

// containerPeakMiB reads the container's peak memory from its cgroup (v2
// memory.peak or v1 max_usage_in_bytes), if this host exposes it.
func containerPeakMiB(name string) (float64, bool) {
	id, err := testenv.Docker(context.Background(), "inspect", "-f", "{{.Id}}", name)
	if err != nil {
		return 0, false
	}
	id = strings.TrimSpace(id)
	for _, p := range []string{
		"/sys/fs/cgroup/system.slice/docker-" + id + ".scope/memory.peak",
		"/sys/fs/cgroup/docker/" + id + "/memory.peak",
		"/sys/fs/cgroup/memory/docker/" + id + "/memory.max_usage_in_bytes", // cgroup v1
	} {
		if b, err := os.ReadFile(p); err == nil {
			n, err := strconv.ParseFloat(strings.TrimSpace(string(b)), 64)
			return n / (1 << 20), err == nil
		}
	}
	return 0, false
}

// TestRunnerSurvivesEscapeBombs: dstack-runner's stripper padded a line
// with two billion spaces for `\033[2000000000C` and was OOM-killed. Here
// the runner runs under a 128 MiB limit while the job prints that, the
// largest moves a terminal allows, and a flood of them; the job ends done
// and the line after the bombs is delivered.
func TestRunnerSurvivesEscapeBombs(t *testing.T) {
	t.Parallel()
	h := startRunnerDocker(t, testenv.Busybox(t), []string{"--memory", "128m", "--memory-swap", "128m"})
	h.start(job("/bin/sh", "-c", `printf '\033[2000000000Cx\n'; printf '0000000000000000000000000\033[B\033[9000000099C0\n'; `+
		`i=0; while [ $i -lt 20000 ]; do printf '\033[65535C\033[65535B\033[1;65535Hz'; i=$((i+1)); done; echo; echo after-the-bombs`))
	c := h.pullUntilDone(3*time.Minute, nil)
	if c.final().State != api.JobDone || !strings.Contains(c.logs.String(), "after-the-bombs") {
		t.Fatalf("final %+v, logs tail %q", c.final(), tailStr(c.logs.String(), 200))
	}
	out, _ := testenv.Docker(context.Background(), "inspect", "-f", "{{.State.OOMKilled}}", h.container)
	if strings.TrimSpace(out) == "true" {
		t.Fatal("the runner was OOM-killed")
	}
	if peak, ok := containerPeakMiB(h.container); ok {
		t.Logf("runner container memory.peak under the escape flood: %.1f MiB (limit 128 MiB)", peak)
	}
}

// rawRequest sends one request and returns the status and body.
func rawRequest(t *testing.T, method, url, body string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestShimRefusesHostileIDsAndNames: every id or name that could reach a
// path, a record or authorized_keys is refused at the door with 400, and
// nothing is written: no record, no container, no unmount.
func TestShimRefusesHostileIDsAndNames(t *testing.T) {
	t.Parallel()
	h := startShim(t, runnerScript(t, "sleep 60"), nil)
	base := strings.TrimSuffix(h.client.BaseURL(), "/")
	task := func(id, name string, extra string) string {
		b, _ := jsonString(id)
		n, _ := jsonString(name)
		return `{"id":` + b + `,"name":` + n + `,"image_name":"` + h.image + `"` + extra + `}`
	}
	// A busy tmpfs that `../../victim` would have reached.
	victim := t.TempDir()
	if out, err := exec.Command("mount", "-t", "tmpfs", "tmpfs", victim).CombinedOutput(); err != nil {
		t.Fatalf("mount: %v %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("umount", "-l", victim).Run() })
	rel, _ := filepath.Rel("/mnt/disks/dstack-volumes", victim)
	cases := []struct{ body, want string }{
		{task("a\nb", "n", ""), "task id"},
		{task("a/b", "n", ""), "task id"},
		{task("..", "n", ""), "task id"},
		{task("x\x00y", "n", ""), "task id"},
		{task(strings.Repeat("i", 300), "n", ""), "task id is 300 bytes long"},
		{task("ok-id", "bad name\n", ""), "task name"},
		{task("ok-id", "n", `,"volumes":[{"backend":"gcp","name":"`+rel+`","volume_id":"v","device_name":"d"}]`), "volumes[0]: volume name"},
		{task("ok-id", "n", `,"volume_mounts":[{"name":"../x","path":"/data"}]`), "volume_mounts[0]: volume name"},
		// Issue 25: control characters in image_name reached every
		// client's terminal; container:<another task> joined its network.
		{`{"id":"ok-id","name":"n","image_name":"ubuntu\u001b]0;pwned\u0007"}`, "not a valid image reference"},
		{task("ok-id", "n", `,"network_mode":"container:victim"`), "network_mode"},
	}
	for _, tc := range cases {
		code, msg := rawRequest(t, "POST", base+"/api/tasks", tc.body)
		if code != 400 || !strings.Contains(msg, tc.want) {
			t.Errorf("%.60q: %d %q, want 400 with %q", tc.body, code, msg, tc.want)
		}
	}
	for _, path := range []string{"/api/tasks/a%0Ab", "/api/tasks/..%2Fx", "/api/tasks/" + strings.Repeat("i", 300)} {
		if code, msg := rawRequest(t, "GET", base+path, ""); code != 400 || !strings.Contains(msg, "task id") {
			t.Errorf("GET %s: %d %q", path, code, msg)
		}
	}
	// A timeout that overflowed time.Duration into an instant kill.
	if code, msg := rawRequest(t, "POST", base+"/api/tasks/any/terminate", `{"timeout":9300000000}`); code != 400 || !strings.Contains(msg, "out of range") {
		t.Errorf("huge timeout: %d %q", code, msg)
	}
	if list, err := h.client.ListTasks(context.Background()); err != nil || len(list) != 0 {
		t.Fatalf("tasks after refusals: %+v %v", list, err)
	}
	if entries, _ := os.ReadDir(filepath.Join(h.home, "tasks")); len(entries) != 0 {
		t.Fatalf("records written for refused submits: %v", entries)
	}
	if exec.Command("mountpoint", "-q", victim).Run() != nil {
		t.Fatal("the tmpfs was unmounted")
	}
}

func jsonString(s string) (string, error) {
	var b strings.Builder
	b.WriteByte('"')
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			b.WriteString(`\` + string(r))
		case r < 0x20:
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte('"')
	return b.String(), nil
}

func openFDs(pid int) int {
	entries, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	return len(entries)
}

// TestShimConnectionFlood: 1,500 connections that never send a byte. The
// shim holds at most its connection cap, drops silent ones after the header
// timeout, and answers again once they are gone.
func TestShimConnectionFlood(t *testing.T) {
	t.Parallel()
	h := startShim(t, runnerScript(t, "sleep 60"), nil)
	addr := h.addr()
	before := openFDs(h.cmd.Process.Pid)
	var conns []net.Conn
	t.Cleanup(func() {
		for _, c := range conns {
			c.Close()
		}
	})
	for range 1500 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatalf("dial %d: %v", len(conns), err)
		}
		conns = append(conns, c)
	}
	time.Sleep(time.Second)
	during := openFDs(h.cmd.Process.Pid)
	t.Logf("shim open files: %d idle, %d with 1,500 silent connections", before, during)
	if during > before+520 {
		t.Fatalf("shim holds %d files with 1,500 silent connections (cap 512)", during)
	}
	// The API answers meanwhile or, at the latest, once silent connections
	// are dropped after the header timeout (10 s).
	deadline := time.Now().Add(90 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, err := h.client.Healthcheck(ctx)
		cancel()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the shim never answered again: %v", err)
		}
	}
	// Every silent connection is eventually dropped: the files go back.
	start := time.Now()
	for openFDs(h.cmd.Process.Pid) > before+20 {
		if time.Since(start) > 90*time.Second {
			t.Fatalf("shim still holds %d files", openFDs(h.cmd.Process.Pid))
		}
		time.Sleep(500 * time.Millisecond)
	}
	t.Logf("shim open files back to %d after %s", openFDs(h.cmd.Process.Pid), time.Since(start).Round(time.Second))
}

// TestRunnerRefusesSparseAndOversizedUploads: a 10 KB sparse tar fails the
// job with a message and writes no 512 MiB file; an upload over the limit
// gets 413 and is not stored.
func TestRunnerRefusesSparseAndOversizedUploads(t *testing.T) {
	t.Parallel()
	h := startRunnerWith(t, testenv.Busybox(t), "--max-upload-bytes", "1048576")
	ctx := context.Background()
	b := job("/bin/sh", "-c", "echo should-not-run")
	b.JobSpec.FileArchives = []api.FileArchive{{ID: "0b5c5c3e-8f4a-4b7e-9d8e-1c2b3a4d5e6f", Path: "/data/in"}}
	if err := h.client.Submit(ctx, b); err != nil {
		t.Fatal(err)
	}
	if err := h.client.UploadCode(ctx, bytes.NewReader(make([]byte, 2<<20))); err == nil || !strings.Contains(err.Error(), "413") && !strings.Contains(err.Error(), "too large") {
		t.Fatalf("oversized code: %v", err)
	}
	if err := h.client.UploadArchive(ctx, "0b5c5c3e-8f4a-4b7e-9d8e-1c2b3a4d5e6f", bytes.NewReader(sparsetar.Archive(t, "gnu"))); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := h.client.Run(ctx); err != nil || !ok {
		t.Fatalf("run: %v %v", ok, err)
	}
	c := h.pullUntilDone(time.Minute, nil)
	if c.final().State != api.JobFailed || !strings.Contains(c.runner.String()+c.final().TerminationMessage, "sparse") {
		t.Fatalf("final %+v runner logs %q", c.final(), tailStr(c.runner.String(), 300))
	}
	if strings.Contains(c.logs.String(), "should-not-run") {
		t.Fatal("the job ran")
	}
	if out, _ := testenv.Docker(ctx, "exec", h.container, "/bin/sh", "-c", "du -sk /data 2>/dev/null || echo none"); strings.Contains(out, "524") {
		t.Fatalf("the sparse file was expanded: %s", out)
	}
}

// TestShimNeverFormatsData: a loop device of random bytes (no signature
// blkid knows) submitted with init_fs through the real shim, by AWS
// device_name and as a GCP disk: both tasks fail with the refusal and the
// disk is unchanged byte for byte.
func TestShimNeverFormatsData(t *testing.T) {
	dev, img := loopdev.Random(t, 16)
	sum := func() [32]byte {
		b, err := os.ReadFile(img)
		if err != nil {
			t.Fatal(err)
		}
		return sha256.Sum256(b)
	}
	before := sum()
	byID := t.TempDir()
	if err := os.Symlink(dev, filepath.Join(byID, "google-raw-db")); err != nil {
		t.Fatal(err)
	}
	p := newShimProc(t, runnerScript(t, "sleep 60"))
	p.start("--volumes-root", t.TempDir(), "--gcp-disk-by-id", byID)
	ctx := context.Background()
	for _, vol := range []api.VolumeInfo{
		{Backend: "gcp", Name: "raw-db", VolumeID: "pd-raw", DeviceName: "raw-db", InitFS: true},
		{Backend: "aws", Name: "raw-db", VolumeID: "vol-0raw", DeviceName: dev, InitFS: true},
	} {
		cfg := api.TaskConfig{ID: randomID("raw"), Name: "rs-" + randomID("raw"), ImageName: testenv.Busybox(t),
			Volumes: []api.VolumeInfo{vol}, VolumeMounts: []api.VolumeMountPoint{{Name: "raw-db", Path: "/data"}}}
		if err := p.client.SubmitTask(ctx, cfg); err != nil {
			t.Fatal(err)
		}
		info := p.waitStatus(cfg.ID, terminated)
		if info.TerminationReason != api.ReasonExecutorError || !strings.Contains(info.TerminationMessage, "has data but no file system we recognise") {
			t.Fatalf("%s: %+v", vol.Backend, info)
		}
	}
	_ = exec.Command("sync").Run()
	if sum() != before {
		t.Fatal("the random-data disk changed")
	}
}

// TestEntrypointRefusesHostileURL: `tandem entrypoint` renders nothing for
// a URL with shell syntax.
func TestEntrypointRefusesHostileURL(t *testing.T) {
	bins := testenv.Binaries(t)
	marker := filepath.Join(t.TempDir(), "INJECTED")
	out, err := exec.Command(bins.Tandem, "entrypoint", "--runner-url", "http://127.0.0.1:9/a;>"+marker+";",
		"--authorized-key", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGa6ZRd7ZG7JXqZbWbKJ3b7h5pI6kY0cUQYvV0c8m1pF u@h").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "runner_url") {
		t.Fatalf("hostile URL rendered: %v %s", err, out)
	}
}

// TestShimServesOnlyTheHost (issue 15): a job in host network mode shares
// the host's loopback but not its mount namespace: it can neither list nor
// create tasks nor install components, while the host can.
func TestShimServesOnlyTheHost(t *testing.T) {
	t.Parallel()
	h := startShim(t, runnerScript(t, "sleep 60"), nil)
	addr := h.addr()
	_, port, _ := net.SplitHostPort(addr)
	ctx := context.Background()
	for _, req := range []string{
		"GET /api/tasks HTTP/1.0\r\nHost: localhost\r\n\r\n",
		"POST /api/tasks HTTP/1.0\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
		"POST /api/components/install HTTP/1.0\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
	} {
		out, err := testenv.Docker(ctx, "run", "--rm", "--network", "host", h.image, "sh", "-c",
			`printf '`+strings.ReplaceAll(strings.ReplaceAll(req, "\r", `\r`), "\n", `\n`)+`' | nc 127.0.0.1 `+port)
		if err != nil {
			t.Fatalf("docker run: %v %s", err, out)
		}
		if !strings.Contains(out, " 403 ") || !strings.Contains(out, "serves only the host") {
			t.Fatalf("%q from a host-network container: %q", strings.SplitN(req, "\r", 2)[0], out)
		}
	}
	if _, err := h.client.ListTasks(ctx); err != nil {
		t.Fatalf("the host itself: %v", err)
	}
	b, _ := os.ReadFile(filepath.Join(h.home, "shim.log"))
	// Containers are refused when their connection is accepted.
	if !strings.Contains(string(b), "API connection refused") {
		t.Fatal("no log line for the refusals")
	}
}

// TestShimRefusesScriptAsComponent (issue 15): an install whose download is
// a script is refused; the installed runner stays and still answers.
func TestShimRefusesScriptAsComponent(t *testing.T) {
	t.Parallel()
	bins := testenv.Binaries(t)
	runner := filepath.Join(t.TempDir(), "dstack-runner")
	b, _ := os.ReadFile(bins.Runner)
	if err := os.WriteFile(runner, b, 0o755); err != nil {
		t.Fatal(err)
	}
	h := startShim(t, runner, nil)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write([]byte("#!/bin/sh\necho dstack-runner version 9.9.9\ntouch /tmp/pwned\n"))
	}))
	defer srv.Close()
	ctx := context.Background()
	if err := h.client.InstallComponent(ctx, api.ComponentRunner, srv.URL+"/dstack-runner"); err != nil {
		t.Fatal(err)
	}
	var runnerInfo api.ComponentInfo
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		comps, err := h.client.Components(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range comps {
			if c.Name == api.ComponentRunner {
				runnerInfo = c
			}
		}
		if runnerInfo.Status != api.ComponentInstalling && runnerInfo.InstallError != "" {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if runnerInfo.Status != api.ComponentInstalled || runnerInfo.Version == "9.9.9" || !strings.Contains(runnerInfo.InstallError, "not an ELF executable") {
		t.Fatalf("after a script install: %+v", runnerInfo)
	}
	out, err := exec.Command(runner, "--version").Output()
	if err != nil || !strings.HasPrefix(string(out), "dstack-runner version ") || strings.Contains(string(out), "9.9.9") {
		t.Fatalf("installed runner: %q %v", out, err)
	}
}

// TestShimThroughServersUnixSocketTunnel: the dstack server reaches the shim
// through `ssh -L <local socket>:localhost:<port>` and speaks HTTP over the
// socket, so its Host header is the URL-quoted socket path and the peer is
// the host's sshd. Both pass the shim's access rules.
func TestShimThroughServersUnixSocketTunnel(t *testing.T) {
	t.Parallel()
	h := startShim(t, runnerScript(t, "sleep 60"), nil)
	sshd := testenv.StartSSHD(t)
	host, port, _ := net.SplitHostPort(sshd.Addr)
	_, shimPort, _ := net.SplitHostPort(h.addr())
	sock := filepath.Join(t.TempDir(), "shim.sock")
	tunnel := exec.Command("ssh", "-N", "-p", port, "-i", sshd.ClientKey, "-o", "UserKnownHostsFile="+sshd.KnownHosts,
		"-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes", "-L", sock+":localhost:"+shimPort, sshd.User+"@"+host)
	testenv.StartDaemon(t, tunnel)
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the tunnel's socket never appeared")
		}
	}
	c := http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}, Timeout: 10 * time.Second}
	// requests-unixsocket's Host: the quoted socket path.
	req, _ := http.NewRequest("GET", "http://x/api/tasks", nil)
	req.Host = url.PathEscape(sock)
	req.Host = strings.ReplaceAll(req.Host, "/", "%2F")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("through the tunnel with Host %q: %d %s", req.Host, resp.StatusCode, b)
	}
}
