package e2e

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	gossh "golang.org/x/crypto/ssh"

	"github.com/tandem-run/tandem/e2e/testenv"
)

type sshRunner struct {
	*runnerHarness
	key string // client private key
}

// startSSHRunner runs a runner whose SSH server authorizes a fresh client
// key, and starts a long job so sessions see the job environment.
func startSSHRunner(t *testing.T, image string) *sshRunner {
	t.Helper()
	key := filepath.Join(t.TempDir(), "id")
	if out, err := exec.Command("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key).CombinedOutput(); err != nil {
		t.Fatalf("ssh-keygen: %v %s", err, out)
	}
	pub, _ := os.ReadFile(key + ".pub")
	h := startRunnerWith(t, image, "--ssh-authorized-key", strings.TrimSpace(string(pub)))
	h.start(job("/bin/sh", "-c", "sleep 600"))
	return &sshRunner{runnerHarness: h, key: key}
}

func (r *sshRunner) sshArgs(user string, extra ...string) []string {
	args := []string{"-p", r.sshPort, "-i", r.key, "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
		"-o", "BatchMode=yes", "-o", "LogLevel=ERROR", "-o", "IdentitiesOnly=yes"}
	args = append(args, extra...)
	return append(args, user+"@127.0.0.1")
}

func (r *sshRunner) ssh(t *testing.T, user string, extra []string, command string) (string, int) {
	t.Helper()
	args := append(r.sshArgs(user, extra...), command)
	cmd := exec.Command("ssh", args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), exitCodeOf(err)
}

func TestSSHBusybox(t *testing.T) {
	t.Parallel()
	r := startSSHRunner(t, testenv.Busybox(t))
	if out, code := r.ssh(t, "root", nil, "echo $DSTACK_RUN_ID $FROM_SPEC"); code != 0 || out != "run-1 yes\n" {
		t.Fatalf("job env in a non-login session: %d %q", code, out)
	}
	if _, code := r.ssh(t, "root", nil, "exit 7"); code != 7 {
		t.Fatalf("exit status %d", code)
	}
	if out, code := r.ssh(t, "user", nil, "id -u; pwd"); code != 0 || out != "1000\n/home/user\n" {
		t.Fatalf("login as user: %d %q", code, out)
	}
	// Wrong key: refused.
	other := filepath.Join(t.TempDir(), "other")
	_ = exec.Command("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", other).Run()
	cmd := exec.Command("ssh", append(r.sshArgs("root", "-o", "PasswordAuthentication=no"), "true")...)
	cmd.Args[4] = other // -i
	if out, err := cmd.CombinedOutput(); exitCodeOf(err) != 255 || !strings.Contains(string(out), "Permission denied") {
		t.Fatalf("wrong key: %v %s", err, out)
	}

	// Password and keyboard-interactive are not offered; garbage on the
	// socket drops that connection only.
	pw := exec.Command("ssh", append(r.sshArgs("root", "-o", "PreferredAuthentications=password,keyboard-interactive"), "true")...)
	if out, err := pw.CombinedOutput(); exitCodeOf(err) != 255 || !strings.Contains(string(out), "Permission denied") {
		t.Fatalf("password auth: %v %s", err, out)
	}
	if c, err := net.Dial("tcp", "127.0.0.1:"+r.sshPort); err == nil {
		_, _ = c.Write([]byte("GET / HTTP/1.1\r\n\r\n\x00\xff garbage\r\n"))
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, _ = io.ReadAll(c)
		c.Close()
	}
	if out, code := r.ssh(t, "root", nil, "echo still-serving"); code != 0 || out != "still-serving\n" {
		t.Fatalf("after garbage: %d %q", code, out)
	}

	// -L to the runner's own API, -R back to a server on the host.
	local := testenv.FreeAddr(t)
	fwd := exec.Command("ssh", r.sshArgs("root", "-N", "-L", local+":127.0.0.1:"+portOf(t, r.runnerHarness))...)
	if err := fwd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = fwd.Process.Kill(); _ = fwd.Wait() }()
	body := httpGetRetry(t, "http://"+local+"/api/healthcheck")
	if !strings.Contains(body, `"service":"dstack-runner"`) {
		t.Fatalf("-L: %q", body)
	}
	hostSrv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "from the host\n") })}
	hostAddr := testenv.FreeAddr(t)
	ln, _ := net.Listen("tcp", hostAddr)
	go func() { _ = hostSrv.Serve(ln) }()
	defer hostSrv.Close()
	remote := testenv.FreeAddr(t)
	if out, code := r.ssh(t, "root", []string{"-R", remote + ":" + hostAddr}, "wget -qO- http://"+remote+"/"); code != 0 || out != "from the host\n" {
		t.Fatalf("-R: %d %q", code, out)
	}
	// -R of a Unix socket, then -L to that socket: both streamlocal directions.
	sock := "/tmp/fwd-" + randomID("s") + ".sock"
	rs := exec.Command("ssh", r.sshArgs("root", "-N", "-R", sock+":"+hostAddr)...)
	if err := rs.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = rs.Process.Kill(); _ = rs.Wait() }()
	local2 := testenv.FreeAddr(t)
	ls := exec.Command("ssh", r.sshArgs("root", "-N", "-L", local2+":"+sock)...)
	if err := ls.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ls.Process.Kill(); _ = ls.Wait() }()
	if body := httpGetRetry(t, "http://"+local2+"/"); body != "from the host\n" {
		t.Fatalf("unix socket forwards: %q", body)
	}
	// A forward to a closed port fails the channel, not the session.
	closed := testenv.FreeAddr(t)
	if out, code := r.ssh(t, "root", []string{"-o", "ExitOnForwardFailure=no", "-L", testenv.FreeAddr(t) + ":" + closed}, "echo alive"); code != 0 || !strings.Contains(out, "alive") {
		t.Fatalf("session with a dead forward: %d %q", code, out)
	}
}

func TestSSHDebianFilesAgentAndMultiplexing(t *testing.T) {
	t.Parallel()
	r := startSSHRunner(t, testenv.Debian(t))
	// scp of 50 MB both ways, verified by checksum.
	dir := t.TempDir()
	src := filepath.Join(dir, "up.bin")
	data := bytes.Repeat([]byte("tandem-scp-"), 50<<20/11)
	if err := os.WriteFile(src, data, 0o644); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(data)
	scpArgs := func(from, to string) []string {
		return []string{"-P", r.sshPort, "-i", r.key, "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", from, to}
	}
	if out, err := exec.Command("scp", scpArgs(src, "root@127.0.0.1:/tmp/up.bin")...).CombinedOutput(); err != nil {
		t.Fatalf("scp up: %v %s", err, out)
	}
	if out, code := r.ssh(t, "root", nil, "sha256sum /tmp/up.bin"); code != 0 || !strings.HasPrefix(out, hex.EncodeToString(sum[:])) {
		t.Fatalf("uploaded checksum: %q", out)
	}
	back := filepath.Join(dir, "down.bin")
	if out, err := exec.Command("scp", scpArgs("root@127.0.0.1:/tmp/up.bin", back)...).CombinedOutput(); err != nil {
		t.Fatalf("scp down: %v %s", err, out)
	}
	got, _ := os.ReadFile(back)
	if sha256.Sum256(got) != sum {
		t.Fatal("downloaded file differs")
	}
	// sftp listing.
	sftp := exec.Command("sftp", "-P", r.sshPort, "-i", r.key, "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-b", "-", "root@127.0.0.1")
	sftp.Stdin = strings.NewReader("cd /tmp\nls -1\n")
	if out, err := sftp.CombinedOutput(); err != nil || !strings.Contains(string(out), "up.bin") {
		t.Fatalf("sftp: %v %s", err, out)
	}
	// Agent forwarding: the socket is there for the session.
	agent := exec.Command("ssh-agent", "-s")
	aout, err := agent.Output()
	if err != nil {
		t.Fatal(err)
	}
	env := os.Environ()
	var agentPid string
	for _, part := range strings.Split(string(aout), ";") {
		part = strings.TrimSpace(part)
		if strings.HasPrefix(part, "SSH_AUTH_SOCK=") || strings.HasPrefix(part, "SSH_AGENT_PID=") {
			env = append(env, part)
			if v, ok := strings.CutPrefix(part, "SSH_AGENT_PID="); ok {
				agentPid = v
			}
		}
	}
	defer func() { _ = exec.Command("kill", agentPid).Run() }()
	a := exec.Command("ssh", append(r.sshArgs("root", "-A"), `test -S "$SSH_AUTH_SOCK" && echo agent-ok`)...)
	a.Env = env
	if out, err := a.CombinedOutput(); err != nil || !strings.Contains(string(out), "agent-ok") {
		t.Fatalf("agent forwarding: %v %s", err, out)
	}
	// 50 concurrent exec channels over one ControlMaster connection.
	ctl := filepath.Join(t.TempDir(), "cm")
	master := exec.Command("ssh", r.sshArgs("root", "-M", "-S", ctl, "-N", "-o", "ControlPersist=no")...)
	if err := master.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = master.Process.Kill(); _ = master.Wait() }()
	for i := 0; i < 100; i++ {
		if _, err := os.Stat(ctl); err == nil {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	var wg sync.WaitGroup
	errs := make(chan string, 50)
	for i := 0; i < 50; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			out, code := r.ssh(t, "root", []string{"-S", ctl}, fmt.Sprintf("echo ch-%d", i))
			if code != 0 || out != fmt.Sprintf("ch-%d\n", i) {
				errs <- fmt.Sprintf("channel %d: %d %q", i, code, out)
			}
		}(i)
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
}

// A PTY session follows window changes (Go client: it can resize on demand).
func TestSSHPtyResize(t *testing.T) {
	t.Parallel()
	r := startSSHRunner(t, testenv.Busybox(t))
	b, _ := os.ReadFile(r.key)
	signer, err := gossh.ParsePrivateKey(b)
	if err != nil {
		t.Fatal(err)
	}
	c, err := gossh.Dial("tcp", "127.0.0.1:"+r.sshPort, &gossh.ClientConfig{User: "root", Auth: []gossh.AuthMethod{gossh.PublicKeys(signer)},
		HostKeyCallback: gossh.InsecureIgnoreHostKey(), Timeout: 10 * time.Second}) //nolint:gosec // test server
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	if err := s.RequestPty("xterm", 40, 100, gossh.TerminalModes{}); err != nil {
		t.Fatal(err)
	}
	in, _ := s.StdinPipe()
	var out bytes.Buffer
	var mu sync.Mutex
	s.Stdout = writerFunc(func(p []byte) (int, error) { mu.Lock(); defer mu.Unlock(); return out.Write(p) })
	if err := s.Shell(); err != nil {
		t.Fatal(err)
	}
	read := func() string { mu.Lock(); defer mu.Unlock(); return out.String() }
	_, _ = io.WriteString(in, "stty size; echo TERM=$TERM\n")
	waitFor(t, func() bool { return strings.Contains(read(), "40 100") && strings.Contains(read(), "TERM=xterm") }, read)
	if err := s.WindowChange(50, 120); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	_, _ = io.WriteString(in, "stty size; exit 3\n")
	waitFor(t, func() bool { return strings.Contains(read(), "50 120") }, read)
	if err := s.Wait(); err == nil || err.(*gossh.ExitError).ExitStatus() != 3 {
		t.Fatalf("pty exit status: %v", err)
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

func waitFor(t *testing.T, ok func() bool, show func() string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out; output so far %q", show())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func httpGetRetry(t *testing.T, url string) string {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := http.Get(url)
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			return string(b)
		}
		if time.Now().After(deadline) {
			t.Fatalf("GET %s: %v", url, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// portOf is the runner API's port.
func portOf(t *testing.T, h *runnerHarness) string {
	t.Helper()
	_, port, err := net.SplitHostPort(strings.TrimPrefix(h.client.BaseURL(), "http://"))
	if err != nil {
		t.Fatal(err)
	}
	return port
}

// -L through the real OpenSSH client: a half-close reaches the target (it
// answers after reading to EOF) and the answer still comes back; when the
// connection ends, the runner lets go of the target even when the target
// never speaks (no forward outlives its channel).
func TestSSHForwardHalfCloseAndClose(t *testing.T) {
	t.Parallel()
	r := startSSHRunner(t, testenv.Busybox(t))
	counter, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer counter.Close()
	go func() {
		for {
			c, err := counter.Accept()
			if err != nil {
				return
			}
			go func() {
				n, _ := io.Copy(io.Discard, c) // to the client's EOF
				fmt.Fprintf(c, "got %d bytes\n", n)
				c.Close()
			}()
		}
	}()
	// The silent target reads to EOF and then holds its end: only the
	// runner closing its socket ends the connection on the runner's side.
	silent, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	held := make(chan net.Conn, 1)
	go func() {
		c, err := silent.Accept()
		if err != nil {
			return
		}
		_, _ = io.Copy(io.Discard, c)
		held <- c
	}()
	defer func() {
		select {
		case c := <-held:
			c.Close()
		default:
		}
	}()
	silentPort := silent.Addr().(*net.TCPAddr).Port

	local, local2 := testenv.FreeAddr(t), testenv.FreeAddr(t)
	fwd := exec.Command("ssh", r.sshArgs("root", "-N", "-L", local+":"+counter.Addr().String(), "-L", local2+":"+silent.Addr().String())...)
	if err := fwd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = fwd.Process.Kill(); _ = fwd.Wait() }()
	var c net.Conn
	for i := 0; ; i++ {
		if c, err = net.Dial("tcp", local); err == nil {
			break
		}
		if i > 500 {
			t.Fatalf("forward did not open: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	payload := bytes.Repeat([]byte("x"), 3<<20+5)
	go func() { _, _ = c.Write(payload); _ = c.(*net.TCPConn).CloseWrite() }()
	_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
	answer, err := io.ReadAll(c)
	c.Close()
	if want := fmt.Sprintf("got %d bytes\n", len(payload)); err != nil || string(answer) != want {
		t.Fatalf("half-close through -L: %q %v, want %q", answer, err, want)
	}

	s, err := net.Dial("tcp", local2)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = s.Write([]byte("hello"))
	time.Sleep(200 * time.Millisecond) // the channel is open at the target
	if ownedSocketsTo(t, silentPort) == 0 {
		t.Fatal("no socket to the silent target while the forward is open")
	}
	// The client's close is a half-close at the target, which, as with
	// OpenSSH's sshd, keeps the forward while the target holds its end; the
	// end of the connection must take it down.
	s.Close()
	_ = fwd.Process.Kill()
	for i := 0; ownedSocketsTo(t, silentPort) > 0; i++ {
		if i > 200 {
			t.Fatal("the runner still holds its socket to the target after the connection ended")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// ownedSocketsTo counts this network namespace's TCP sockets to 127.0.0.1:port
// that a process still holds (/proc/net/tcp: a socket let go shows inode 0
// while the kernel finishes it).
func ownedSocketsTo(t *testing.T, port int) int {
	t.Helper()
	data, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("0100007F:%04X", port)
	n := 0
	for _, line := range strings.Split(string(data), "\n")[1:] {
		f := strings.Fields(line)
		if len(f) > 9 && f[2] == want && f[9] != "0" {
			n++
		}
	}
	return n
}
