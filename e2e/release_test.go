package e2e

import (
	"context"
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/shimclient"
	"github.com/tandem-run/tandem/common/version"
	"github.com/tandem-run/tandem/e2e/testenv"
)

var releaseFiles = []string{
	"dstack-shim-linux-amd64", "dstack-shim-linux-arm64",
	"dstack-runner-linux-amd64", "dstack-runner-linux-arm64",
	"tandem-linux-amd64", "tandem-linux-arm64", "tandem-darwin-amd64", "tandem-darwin-arm64",
}

// TestReleaseTree: every target is cross-built, the sums verify, and the
// version file says what the binaries report.
func TestReleaseTree(t *testing.T) {
	bin := testenv.Dist(t, version.ProtocolLevel)
	for _, f := range releaseFiles {
		if fi, err := os.Stat(filepath.Join(bin, f)); err != nil || fi.Size() < 1<<20 {
			t.Errorf("%s: %v", f, err)
		}
	}
	cmd := exec.Command("sha256sum", "-c", "SHA256SUMS")
	cmd.Dir = bin
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("SHA256SUMS: %v\n%s", err, out)
	}
	v, err := os.ReadFile(filepath.Join(bin, "..", "version"))
	if err != nil || strings.TrimSpace(string(v)) != version.ProtocolLevel {
		t.Fatalf("version file: %q %v", v, err)
	}
	out, err := exec.Command(filepath.Join(bin, "dstack-shim-linux-amd64"), "--version").Output()
	if err != nil || strings.TrimSpace(string(out)) != "dstack-shim version "+strings.TrimSpace(string(v)) {
		t.Fatalf("shim --version %q %v", out, err)
	}
}

// fileFormat: the mach-o and ELF headers the cross-builds must carry.
func TestReleaseTargetsAreWhatTheyClaim(t *testing.T) {
	bin := testenv.Dist(t, version.ProtocolLevel)
	want := map[string]string{
		"dstack-shim-linux-arm64": "ARM aarch64", "dstack-runner-linux-arm64": "ARM aarch64",
		"dstack-shim-linux-amd64": "x86-64", "dstack-runner-linux-amd64": "x86-64",
		"tandem-darwin-arm64": "Mach-O 64-bit arm64", "tandem-darwin-amd64": "Mach-O 64-bit x86_64",
	}
	for f, w := range want {
		out, err := exec.Command("file", "-b", filepath.Join(bin, f)).Output()
		if err != nil {
			t.Skipf("file(1): %v", err)
		}
		if !strings.Contains(string(out), w) {
			t.Errorf("%s: %s (want %s)", f, out, w)
		}
		if strings.HasPrefix(f, "dstack-runner") && !strings.Contains(string(out), "statically linked") {
			t.Errorf("%s is not static: %s", f, out)
		}
	}
}

func requireQemu(t *testing.T) string {
	q, err := exec.LookPath("qemu-aarch64-static")
	if err != nil {
		if testenv.InCI() {
			t.Fatal("qemu-aarch64-static missing (make deps installs qemu-user-static)")
		}
		t.Skip("qemu-aarch64-static missing")
	}
	return q
}

// TestArm64UnderQemu: each arm64 binary prints its version under
// qemu-user, and the arm64 runner, as a container's entrypoint, serves its
// API and accepts a real SSH login.
func TestArm64UnderQemu(t *testing.T) {
	q := requireQemu(t)
	bin := testenv.Dist(t, version.ProtocolLevel)
	for _, c := range []struct{ file, want string }{
		{"dstack-shim-linux-arm64", "dstack-shim version " + version.ProtocolLevel},
		{"dstack-runner-linux-arm64", "dstack-runner version " + version.ProtocolLevel},
		{"tandem-linux-arm64", "tandem version "},
	} {
		// The shim links glibc (cgo for NVML): the arm64 sysroot of Debian's
		// cross toolchain stands in for the target's libc.
		out, err := exec.Command(q, "-L", "/usr/aarch64-linux-gnu", filepath.Join(bin, c.file), "--version").CombinedOutput()
		if err != nil || !strings.HasPrefix(strings.TrimSpace(string(out)), c.want) {
			t.Fatalf("%s --version under qemu: %v %q", c.file, err, out)
		}
	}

	testenv.RequireDocker(t)
	key := filepath.Join(t.TempDir(), "id")
	if out, err := exec.Command("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key).CombinedOutput(); err != nil {
		t.Fatalf("ssh-keygen: %v %s", err, out)
	}
	pub, _ := os.ReadFile(key + ".pub")
	_, port, _ := net.SplitHostPort(testenv.FreeAddr(t))
	_, sshPort, _ := net.SplitHostPort(testenv.FreeAddr(t))
	name := randomID("arm64-runner")
	ctx := context.Background()
	_, err := testenv.Docker(ctx, "run", "-d", "--init", "--name", name, "--network", "host",
		"-v", q+":/usr/bin/qemu-aarch64-static:ro", "-v", filepath.Join(bin, "dstack-runner-linux-arm64")+":/usr/local/bin/dstack-runner:ro",
		"--entrypoint", "/usr/bin/qemu-aarch64-static", testenv.Busybox(t),
		"/usr/local/bin/dstack-runner", "start", "--temp-dir", "/tmp/runner", "--http-address", "127.0.0.1",
		"--http-port", port, "--ssh-port", sshPort, "--ssh-authorized-key", strings.TrimSpace(string(pub)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = testenv.Docker(context.Background(), "rm", "-f", name) })
	var hc api.HealthcheckResponse
	deadline := time.Now().Add(60 * time.Second)
	for {
		resp, err := http.Get("http://127.0.0.1:" + port + "/api/healthcheck")
		if err == nil {
			_ = json.NewDecoder(resp.Body).Decode(&hc)
			resp.Body.Close()
			break
		}
		if time.Now().After(deadline) {
			out, _ := testenv.Docker(ctx, "logs", name)
			t.Fatalf("arm64 runner did not answer: %v\n%s", err, out)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if hc.Service != "dstack-runner" || hc.Version != version.ProtocolLevel || hc.TandemVersion == "" {
		t.Fatalf("arm64 healthcheck: %+v", hc)
	}
	out, err := exec.Command("ssh", "-p", sshPort, "-i", key, "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
		"-o", "BatchMode=yes", "-o", "LogLevel=ERROR", "-o", "IdentitiesOnly=yes", "root@127.0.0.1", "echo login-on-arm64-runner; id -u").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "login-on-arm64-runner\n0") {
		logs, _ := testenv.Docker(ctx, "logs", name)
		t.Fatalf("ssh into the arm64 runner: %v %q\n%s", err, out, logs)
	}
}

// instanceCheck replays one round of the dstack server's instance check
// (server/background/pipeline_tasks/instances/check.py,
// _maybe_install_components) against a shim: install a component whose
// installed version is not the expected one (unless it is installing), then
// restart the shim with /api/shutdown when the installed shim differs from
// the running one, nothing was just requested or is installing, and every
// task is terminated.
// templates are DSTACK_SHIM_DOWNLOAD_URL and DSTACK_RUNNER_DOWNLOAD_URL.
func instanceCheck(t *testing.T, c *shimclient.Client, expected string, templates map[api.ComponentName]string) (installs []string, restart bool) {
	t.Helper()
	ctx := context.Background()
	comps, err := c.Components(ctx)
	if err != nil {
		t.Fatalf("components: %v", err)
	}
	installedShim, requested, installing := "", false, false
	for _, comp := range comps {
		if comp.Status == api.ComponentInstalling {
			installing = true
			continue
		}
		if comp.Name == api.ComponentShim && comp.Status == api.ComponentInstalled {
			installedShim = comp.Version
		}
		if comp.Version != "" && comp.Version == expected {
			continue
		}
		url := strings.NewReplacer("{version}", expected, "{arch}", "amd64").Replace(templates[comp.Name])
		if err := c.InstallComponent(ctx, comp.Name, url); err != nil {
			// The server logs a refused install request and moves on.
			t.Logf("install %s refused: %v", comp.Name, err)
			continue
		}
		installs = append(installs, string(comp.Name))
		requested = true
	}
	hc, err := c.Healthcheck(ctx)
	if err != nil {
		t.Fatal(err)
	}
	tasks, err := c.ListTasks(ctx)
	if err != nil {
		t.Fatal(err)
	}
	safe := true
	for _, tk := range tasks {
		safe = safe && tk.Status == api.TaskTerminated
	}
	if installedShim == "" || installedShim == hc.Version || requested || installing || !safe {
		return installs, false
	}
	if err := c.Shutdown(ctx, false); err != nil {
		t.Fatalf("shutdown: %v", err)
	}
	return installs, true
}

// waitInstalls waits until no component is installing.
func waitInstalls(t *testing.T, c *shimclient.Client, logs func() string) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		comps, err := c.Components(context.Background())
		if err == nil {
			busy := false
			for _, comp := range comps {
				busy = busy || comp.Status == api.ComponentInstalling
			}
			if !busy {
				return
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	comps, err := c.Components(context.Background())
	t.Fatalf("installs did not finish: %+v %v\n%s", comps, err, logs())
}

// buildOld builds shim and runner reporting an older dstack release.
func buildOld(t *testing.T, dir, dstackVersion string) {
	t.Helper()
	ld := "-X github.com/tandem-run/tandem/common/version.dstack=" + dstackVersion
	for _, b := range []string{"dstack-shim", "dstack-runner"} {
		cmd := exec.Command("go", "build", "-trimpath", "-ldflags", ld, "-o", filepath.Join(dir, b), "./cmd/"+b)
		cmd.Dir = ".."
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("build old %s: %v\n%s", b, err, out)
		}
	}
}

// TestVersionsConverge serves the release tree in dstack's layout and runs
// the server's instance check against a real shim for several rounds:
// fresh host (runner missing) and an upgrade from an older release. Each
// component is installed at most once, the shim restarts at most once, and
// then nothing more happens. The three places that report a version agree.
func TestVersionsConverge(t *testing.T) {
	testenv.RequireDocker(t)
	bin := testenv.Dist(t, version.ProtocolLevel)
	root := filepath.Dir(filepath.Dir(bin)) // dist/: <version>/binaries/...
	var mu sync.Mutex
	var downloads []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		downloads = append(downloads, r.URL.Path)
		mu.Unlock()
		http.FileServer(http.Dir(root)).ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	expected := version.ProtocolLevel
	templates := map[api.ComponentName]string{
		api.ComponentShim:   srv.URL + "/{version}/binaries/dstack-shim-linux-{arch}",
		api.ComponentRunner: srv.URL + "/{version}/binaries/dstack-runner-linux-{arch}",
	}

	for _, tc := range []struct {
		name    string
		prepare func(dir string)
		want    []string // components installed in the first round
		restart bool
	}{
		{"fresh host, runner not installed", func(dir string) {
			copyFile(t, filepath.Join(bin, "dstack-shim-linux-amd64"), filepath.Join(dir, "dstack-shim"))
		}, []string{"dstack-runner"}, false},
		{"upgrade from 0.21.2", func(dir string) { buildOld(t, dir, "0.21.2") }, []string{"dstack-runner", "dstack-shim"}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mu.Lock()
			downloads = nil
			mu.Unlock()
			dir := t.TempDir()
			tc.prepare(dir)
			p := &restartableShim{t: t, bin: filepath.Join(dir, "dstack-shim"), runner: filepath.Join(dir, "dstack-runner"), home: t.TempDir()}
			testenv.UnmountUnder(t, p.home)
			p.start()
			var installs []string
			restarts := 0
			for round := 0; round < 6; round++ {
				got, restart := instanceCheck(t, p.client, expected, templates)
				if round == 0 && strings.Join(got, ",") != strings.Join(tc.want, ",") {
					t.Fatalf("round 0 installs %v, want %v", got, tc.want)
				}
				installs = append(installs, got...)
				if restart {
					restarts++
					p.waitExit()
					p.start() // what systemd's Restart=always does
				}
				waitInstalls(t, p.client, p.logs)
			}
			if len(installs) != len(tc.want) {
				comps, _ := p.client.Components(context.Background())
				t.Fatalf("installs over six rounds: %v (want each of %v once); components now %+v", installs, tc.want, comps)
			}
			if (restarts == 1) != tc.restart || restarts > 1 {
				t.Fatalf("restarts: %d", restarts)
			}
			mu.Lock()
			t.Logf("%s: installs %v, restarts %d, downloads %v", tc.name, installs, restarts, downloads)
			mu.Unlock()
			// Converged: every place says the expected version.
			hc, _ := p.client.Healthcheck(context.Background())
			comps, _ := p.client.Components(context.Background())
			if hc.Version != expected || hc.TandemVersion == "" {
				t.Fatalf("healthcheck %+v", hc)
			}
			for _, c := range comps {
				if c.Version != expected || c.Status != api.ComponentInstalled {
					t.Fatalf("component %+v", c)
				}
			}
			for _, b := range []string{p.bin, p.runner} {
				out, _ := exec.Command(b, "--version").Output()
				if f := strings.Fields(string(out)); len(f) != 3 || f[2] != expected {
					t.Fatalf("%s --version: %q", b, out)
				}
			}
			p.stop()
		})
	}
}

func copyFile(t *testing.T, src, dst string) {
	t.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dst, b, 0o755); err != nil {
		t.Fatal(err)
	}
}

// restartableShim runs the shim from its installed path, as systemd would,
// so a self-update takes effect on the next start.
type restartableShim struct {
	t                 *testing.T
	bin, runner, home string
	port              string
	cmd               *exec.Cmd
	exited            chan error
	client            *shimclient.Client
}

func (p *restartableShim) start() {
	p.t.Helper()
	if p.port == "" {
		_, p.port, _ = net.SplitHostPort(testenv.FreeAddr(p.t))
		p.client, _ = shimclient.New("127.0.0.1:" + p.port)
		p.t.Cleanup(p.stop)
	}
	p.cmd = exec.Command(p.bin, "--shim-home", p.home, "--shim-http-port", p.port, "--runner-binary-path", p.runner, "--shim-binary-path", p.bin)
	logf, _ := os.OpenFile(filepath.Join(p.home, "stderr"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	p.cmd.Stdout, p.cmd.Stderr = logf, logf
	testenv.Isolate(p.cmd)
	if err := p.cmd.Start(); err != nil {
		p.t.Fatal(err)
	}
	p.exited = make(chan error, 1)
	go func(c *exec.Cmd) { p.exited <- c.Wait(); logf.Close() }(p.cmd)
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, err := p.client.Healthcheck(context.Background()); err == nil {
			return
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(filepath.Join(p.home, "stderr"))
			p.t.Fatalf("shim did not start:\n%s", b)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (p *restartableShim) logs() string {
	b, _ := os.ReadFile(filepath.Join(p.home, "shim.log"))
	return string(b)
}

func (p *restartableShim) waitExit() {
	p.t.Helper()
	select {
	case <-p.exited:
		p.cmd = nil
	case <-time.After(20 * time.Second):
		p.t.Fatal("the shim did not exit after /api/shutdown")
	}
}

func (p *restartableShim) stop() {
	if p.cmd != nil && p.cmd.Process != nil {
		_ = p.cmd.Process.Kill()
		<-p.exited
		p.cmd = nil
	}
}

// TestReleaseShimStartsOnGlibc231: the released amd64 shim (cgo, for NVML)
// starts in a Debian 11 root (glibc 2.31, as Ubuntu 20.04), and asks no
// newer GLIBC_ symbol version than 2.31 of it.
func TestReleaseShimStartsOnGlibc231(t *testing.T) {
	bin := testenv.Dist(t, version.ProtocolLevel)
	out, err := exec.Command(filepath.Join(testenv.ModuleRoot(), "scripts", "sysroot.sh")).Output()
	if err != nil {
		t.Fatalf("sysroot.sh: %v", err)
	}
	root := strings.TrimSpace(string(out))
	libc, err := exec.Command("chroot", root, "getconf", "GNU_LIBC_VERSION").CombinedOutput()
	if err != nil || strings.TrimSpace(string(libc)) != "glibc 2.31" {
		t.Fatalf("the Debian 11 root: %v %s", err, libc)
	}
	dir, err := os.MkdirTemp(filepath.Join(root, "tmp"), "shim-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	b, err := os.ReadFile(filepath.Join(bin, "dstack-shim-linux-amd64"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "dstack-shim"), b, 0o755); err != nil {
		t.Fatal(err)
	}
	inRoot := "/" + filepath.Join(strings.TrimPrefix(dir, root), "dstack-shim")
	got, err := exec.Command("chroot", root, inRoot, "--version").CombinedOutput()
	if err != nil || !strings.HasPrefix(string(got), "dstack-shim version ") {
		t.Fatalf("the release shim on glibc 2.31: %v\n%s", err, got)
	}
	dyn, err := exec.Command("objdump", "-T", filepath.Join(dir, "dstack-shim")).Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range strings.Fields(string(dyn)) {
		v, ok := strings.CutPrefix(strings.Trim(f, "()"), "GLIBC_2.")
		if !ok {
			continue
		}
		minor, _, _ := strings.Cut(v, ".")
		if n, _ := strconv.Atoi(minor); n > 31 {
			t.Fatalf("the shim imports %s, newer than glibc 2.31", f)
		}
	}
}
