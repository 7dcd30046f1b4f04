package e2e

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	gossh "golang.org/x/crypto/ssh"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/e2e/testenv"
)

// asUID sends one HTTP request from a process of uid (an ordinary local
// account) with busybox nc and returns the raw answer; a refusal's 403 and
// its text show in it.
func asUID(t *testing.T, uid int, method, url, body string) string {
	t.Helper()
	bb, err := exec.LookPath("busybox")
	if err != nil {
		t.Fatal("busybox missing (make deps installs busybox-static)")
	}
	hostport, path, _ := strings.Cut(strings.TrimPrefix(url, "http://"), "/")
	host, port, _ := net.SplitHostPort(hostport)
	req := method + " /" + path + " HTTP/1.1\r\nHost: " + hostport + "\r\nConnection: close\r\n"
	if body != "" {
		req += "Content-Type: application/json\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\n"
	}
	req += "\r\n" + body
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bb, "nc", host, port)
	cmd.Stdin = strings.NewReader(req)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(uid)}}
	out, _ := cmd.CombinedOutput()
	return string(out)
}

// sudoersFile grants user ALL as cloud-init does for a VM image's default
// user (ubuntu, riftuser) and dstack requires of an SSH fleet's user. The
// shim asks the host's sudo, so sudo must be installed (make deps does);
// the file is removed after the test.
func sudoersFile(t *testing.T, user string) {
	t.Helper()
	if _, err := exec.LookPath("sudo"); err != nil {
		if testenv.InCI() {
			t.Fatal("sudo missing (make deps installs it)")
		}
		t.Skip("sudo missing (make deps installs it)")
	}
	path := filepath.Join("/etc/sudoers.d", "90-"+user)
	if err := os.WriteFile(path, []byte(user+" ALL=(ALL) NOPASSWD:ALL\n"), 0o440); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.Remove(path) })
}

// loginUser makes a local account that key logins accept (not locked).
func loginUser(t *testing.T, name string) int {
	t.Helper()
	hostUser(t, name)
	if out, err := exec.Command("usermod", "-p", "*", name).CombinedOutput(); err != nil {
		t.Fatalf("usermod: %v %s", err, out)
	}
	out, err := exec.Command("id", "-u", name).Output()
	if err != nil {
		t.Fatal(err)
	}
	uid, _ := strconv.Atoi(strings.TrimSpace(string(out)))
	return uid
}

// tunnel forwards a local port to target through the real sshd as user,
// as the dstack server does (ssh -L to the host's loopback), and returns
// the local address.
func tunnel(t *testing.T, sshd *testenv.SSHD, user, target string) string {
	t.Helper()
	local := testenv.FreeAddr(t)
	host, port, _ := net.SplitHostPort(sshd.Addr)
	cmd := exec.Command("ssh", "-N", "-p", port, "-i", sshd.ClientKey, "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
		"-o", "UserKnownHostsFile="+sshd.KnownHosts, "-o", "ExitOnForwardFailure=yes",
		"-L", local+":"+target, user+"@"+host)
	testenv.StartDaemon(t, cmd)
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		if c, err := net.Dial("tcp", local); err == nil {
			c.Close()
			return local
		}
		time.Sleep(50 * time.Millisecond)
	}
	b, _ := os.ReadFile(filepath.Join(filepath.Dir(sshd.ClientKey), "sshd.log"))
	t.Fatalf("ssh -L as %s did not open %s; sshd log:\n%s", user, local, b)
	return ""
}

// TestShimAdmitsOnlyRootEquivalentAccounts (issue 37, hole 1): on the
// build before the fix, uid 65534 created a task with an instance mount of
// a root-only directory. Now an ordinary account gets 403 naming its uid
// and nothing is created; every path the dstack server uses still works:
// root, a sudoer as an SSH fleet's or a VM image's default user (the
// forwarded connection is owned by the login user, which the test shows),
// a member of the Docker socket's group; an ordinary account through the
// same tunnel is refused.
func TestShimAdmitsOnlyRootEquivalentAccounts(t *testing.T) {
	testenv.RequireDocker(t)
	bins := testenv.Binaries(t)
	h := startShim(t, bins.Runner, nil)
	secret := t.TempDir() // root-only (0700)
	body := `{"id":"` + randomID("t") + `","name":"steal","image_name":"` + h.image + `","container_user":"root","network_mode":"host",` +
		`"instance_mounts":[{"instance_path":"` + secret + `","path":"/secret"}]}`
	out := asUID(t, 65534, "POST", "http://"+h.addr()+"/api/tasks", body)
	if !strings.Contains(out, "403") || !strings.Contains(out, "uid 65534") || !strings.Contains(out, "root-equivalent") {
		t.Fatalf("nobody's submit was not refused with its uid: %q", out)
	}
	if items, err := h.client.ListTasks(context.Background()); err != nil || len(items) != 0 {
		t.Fatalf("a refused submit left tasks: %+v %v", items, err)
	}
	if out := asUID(t, 65534, "GET", "http://"+h.addr()+"/api/healthcheck", ""); !strings.Contains(out, "403") {
		t.Fatalf("nobody's healthcheck: %q", out)
	}

	sshd := testenv.StartSSHD(t)
	// sshd reads the shared authorized_keys as the logging-in user: the
	// test's own temp dirs must let the accounts through.
	sshdDir := filepath.Dir(sshd.ClientKey)
	for _, d := range []string{sshdDir, filepath.Dir(sshdDir)} {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(filepath.Join(sshdDir, "authorized_keys"), 0o644); err != nil {
		t.Fatal(err)
	}
	sudoer, plain, dockerUser := "tandem-e2e-sudo", "tandem-e2e-plain", "tandem-e2e-dock"
	loginUser(t, sudoer)
	sudoersFile(t, sudoer)
	plainUID := loginUser(t, plain)
	loginUser(t, dockerUser)
	if grp, err := exec.Command("stat", "-c", "%G", "/var/run/docker.sock").Output(); err == nil && strings.TrimSpace(string(grp)) != "root" {
		if out, err := exec.Command("usermod", "-a", "-G", strings.TrimSpace(string(grp)), dockerUser).CombinedOutput(); err != nil {
			t.Fatalf("usermod -G: %v %s", err, out)
		}
	} else {
		dockerUser = "" // the socket has no group of its own here
	}
	for _, c := range []struct {
		user  string
		admit bool
	}{{"root", true}, {sudoer, true}, {dockerUser, true}, {plain, false}} {
		if c.user == "" {
			continue
		}
		local := tunnel(t, sshd, c.user, h.addr())
		out := asUID(t, 0, "GET", "http://"+local+"/api/healthcheck", "")
		refused := strings.Contains(out, "403")
		if refused == c.admit {
			t.Errorf("%s through ssh -L: admitted=%v, want %v: %q", c.user, !refused, c.admit, out)
		}
		if !c.admit && !strings.Contains(out, "uid "+strconv.Itoa(plainUID)+" ("+plain+")") {
			t.Errorf("the refusal does not name the tunnel's user: %q", out)
		}
	}
}

// TestTaskPortsAdmitOnlyRootEquivalentAccounts (issue 37, hole 2): on the
// build before the fix, Docker published a bridge task's runner ports on
// 127.0.0.1 to every local account, and uid 65534 read the job's output.
// Now the shim forwards them behind the API's rule: an ordinary account
// gets 403 on the HTTP port and nothing on the SSH port, while root (the
// control) drives the runner through the same port.
func TestTaskPortsAdmitOnlyRootEquivalentAccounts(t *testing.T) {
	h, _, runnerPort := realStack(t)
	info, r, _ := bridgeRunner(t, h, runnerPort)
	r.start(job("/bin/sh", "-c", "echo tenant-secret-output; sleep 1"))
	var httpPort, sshPort string
	for _, p := range info.Ports {
		if strconv.Itoa(p.Container) == runnerPort {
			httpPort = strconv.Itoa(p.Host)
		} else {
			sshPort = strconv.Itoa(p.Host)
		}
	}
	if out := asUID(t, 65534, "GET", "http://127.0.0.1:"+httpPort+"/api/pull?timestamp=0", ""); !strings.Contains(out, "403") || strings.Contains(out, "tenant-secret-output") {
		t.Fatalf("nobody reached the runner's API: %q", out)
	}
	var read bool
	var last api.PullResponse
	var lastErr error
	for deadline := time.Now().Add(30 * time.Second); !read && time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		last, lastErr = r.client.Pull(context.Background(), 0)
		read = lastErr == nil && logsHave(last, "tenant-secret-output")
	}
	if !read {
		t.Fatalf("root (the control) did not read the job through the same port: %+v %v", last, lastErr)
	}
	// The SSH port: nobody's connection is closed before any SSH banner.
	out := asUID(t, 65534, "GET", "http://127.0.0.1:"+sshPort+"/", "")
	if strings.Contains(out, "SSH-2.0") || !strings.Contains(out, "403") {
		t.Fatalf("nobody reached the runner's SSH server: %q", out)
	}
	if docker, err := testenv.Docker(context.Background(), "inspect", "-f", "{{json .HostConfig.PortBindings}}", h.names[len(h.names)-1]); err == nil && strings.Contains(docker, "HostPort") {
		t.Fatalf("Docker still publishes the task's ports: %s", docker)
	}
}

// TestReplacedSubmitLeavesNoKey (issue 37, hole 3): on the build before the
// fix, a throw-away /api/submit carrying the attacker's ssh_key and two
// job_ips, replaced by the real submit, left the attacker's key authorized
// on the runner's SSH server. Now only the key of the submit that runs is
// authorized: the real cluster key logs in (the control), the attacker's
// does not.
func TestReplacedSubmitLeavesNoKey(t *testing.T) {
	h, _, runnerPort := realStack(t)
	info, r, _ := bridgeRunner(t, h, runnerPort)
	var sshPort string
	for _, p := range info.Ports {
		if strconv.Itoa(p.Container) != runnerPort {
			sshPort = strconv.Itoa(p.Host)
		}
	}
	dir := t.TempDir()
	attackerPub := testenv.KeyGen(t, filepath.Join(dir, "attacker"), "ed25519")
	realPub := testenv.KeyGen(t, filepath.Join(dir, "cluster"), "ed25519")
	realPriv, _ := os.ReadFile(filepath.Join(dir, "cluster"))
	b := job("/bin/sh", "-c", "sleep 30")
	b.ClusterInfo = api.ClusterInfo{JobIPs: []string{"10.0.0.1", "10.0.0.2"}, MasterJobIP: "10.0.0.1"}
	b.JobSpec.SSHKey = &api.SSHKey{Public: attackerPub, Private: "x"}
	if err := r.client.Submit(context.Background(), b); err != nil {
		t.Fatal(err)
	}
	b.JobSpec.SSHKey = &api.SSHKey{Public: realPub, Private: string(realPriv)}
	r.start(b)
	login := func(key string) error {
		pem, _ := os.ReadFile(filepath.Join(dir, key))
		signer, err := gossh.ParsePrivateKey(pem)
		if err != nil {
			t.Fatal(err)
		}
		var c *gossh.Client
		deadline := time.Now().Add(10 * time.Second)
		for {
			c, err = gossh.Dial("tcp", "127.0.0.1:"+sshPort, &gossh.ClientConfig{User: "root", Auth: []gossh.AuthMethod{gossh.PublicKeys(signer)},
				HostKeyCallback: gossh.InsecureIgnoreHostKey(), Timeout: 5 * time.Second})
			if err == nil || strings.Contains(err.Error(), "unable to authenticate") || time.Now().After(deadline) {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		if err == nil {
			c.Close()
		}
		return err
	}
	if err := login("cluster"); err != nil {
		t.Fatalf("the cluster key of the submit that ran (the control): %v", err)
	}
	if err := login("attacker"); err == nil {
		t.Fatal("the replaced submit's key logs in to the container")
	}
}

// TestHostNetworkRunnerAdmitsOnlyRootEquivalentAccounts (issue 37, hole 2,
// host network): a host-network runner listens on the host's loopback
// itself, where the shim cannot gate it; the shim tells it the uids of the
// root-equivalent accounts and it refuses the rest. On the build before
// the fix uid 65534 read its healthcheck and could submit first.
func TestHostNetworkRunnerAdmitsOnlyRootEquivalentAccounts(t *testing.T) {
	h, _, runnerPort := realStack(t)
	cfg := h.submit(api.TaskConfig{NetworkMode: "host"})
	if info := h.wait(cfg.ID, 60*time.Second, func(i api.TaskInfoResponse) bool {
		return i.Status != api.TaskPending && i.Status != api.TaskPreparing && i.Status != api.TaskPulling && i.Status != api.TaskCreating
	}); info.Status != api.TaskRunning {
		t.Fatalf("host task did not run: %+v", info)
	}
	url := "http://127.0.0.1:" + runnerPort + "/api/healthcheck"
	var root string
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if root = asUID(t, 0, "GET", url, ""); strings.Contains(root, " 200 ") {
			break
		}
	}
	if !strings.Contains(root, " 200 ") || !strings.Contains(root, "dstack-runner") {
		t.Fatalf("root (the control) does not reach the runner: %q", root)
	}
	out := asUID(t, 65534, "POST", "http://127.0.0.1:"+runnerPort+"/api/submit", `{"run":{}}`)
	if !strings.Contains(out, " 403 ") || !strings.Contains(out, "uid 65534") {
		t.Fatalf("nobody reached the host-network runner: %q", out)
	}
	// Nor the job's stdin (the refusal is the connection's, whatever the route).
	if out := asUID(t, 65534, "GET", "http://127.0.0.1:"+runnerPort+api.StdinPath, ""); !strings.Contains(out, " 403 ") {
		t.Fatalf("nobody reached the host-network runner's stdin stream: %q", out)
	}
}

// TestMetricsAddressServesScrapersOnly: with --metrics-address, GET
// /metrics answers any scraper (here an ordinary account, and a client in
// its own mount namespace as a containerised Prometheus is), while the task
// API on the same listener does not exist and the API port still refuses
// them.
func TestMetricsAddressServesScrapersOnly(t *testing.T) {
	testenv.RequireDocker(t)
	bins := testenv.Binaries(t)
	maddr := testenv.FreeAddr(t)
	h := startShim(t, bins.Runner, nil, "--metrics-address", maddr)
	var out string
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if out = asUID(t, 65534, "GET", "http://"+maddr+"/metrics", ""); strings.Contains(out, " 200 ") {
			break
		}
	}
	if !strings.Contains(out, " 200 ") || !strings.Contains(out, "tandem_shim_") {
		t.Fatalf("nobody could not scrape the metrics address: %q", out)
	}
	if out := asUID(t, 65534, "GET", "http://"+maddr+"/api/tasks", ""); !strings.Contains(out, " 404 ") {
		t.Fatalf("the metrics address serves the task API: %q", out)
	}
	if out := asUID(t, 65534, "GET", "http://"+h.addr()+"/metrics", ""); !strings.Contains(out, " 403 ") {
		t.Fatalf("the API port serves nobody: %q", out)
	}
	bb, _ := exec.LookPath("busybox")
	host, port, _ := net.SplitHostPort(maddr)
	cmd := exec.Command("unshare", "--mount", bb, "nc", host, port)
	cmd.Stdin = strings.NewReader("GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
	if b, _ := cmd.CombinedOutput(); !strings.Contains(string(b), " 200 ") {
		t.Fatalf("a namespaced scraper could not scrape: %q", b)
	}
}
