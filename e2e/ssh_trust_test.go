package e2e

import (
	"bytes"
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	gossh "golang.org/x/crypto/ssh"

	"github.com/tandem-run/tandem/e2e/testenv"
)

// Issue 15: an SSH login can do no more than its user and its key allow.

type loginKey struct{ priv, pub string }

func newLoginKey(t *testing.T) loginKey {
	t.Helper()
	p := filepath.Join(t.TempDir(), "id")
	if out, err := exec.Command("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", p).CombinedOutput(); err != nil {
		t.Fatalf("ssh-keygen: %v %s", err, out)
	}
	pub, _ := os.ReadFile(p + ".pub")
	return loginKey{priv: p, pub: strings.TrimSpace(string(pub))}
}

// openssh runs the real ssh client with key against the runner: options
// (all but the last argument), then user@127.0.0.1, then the command.
func openssh(t *testing.T, port string, key loginKey, user string, args ...string) (string, int) {
	t.Helper()
	argv := []string{"-p", port, "-i", key.priv, "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
		"-o", "BatchMode=yes", "-o", "LogLevel=ERROR", "-o", "IdentitiesOnly=yes", "-o", "ConnectTimeout=20"}
	argv = append(argv, args[:len(args)-1]...)
	argv = append(argv, user+"@127.0.0.1", args[len(args)-1])
	cmd := exec.Command("ssh", argv...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), exitCodeOf(err)
}

// goClient logs in with x/crypto's client (for forwards the test drives).
func goClient(t *testing.T, port string, key loginKey, user string) *gossh.Client {
	t.Helper()
	b, _ := os.ReadFile(key.priv)
	signer, err := gossh.ParsePrivateKey(b)
	if err != nil {
		t.Fatal(err)
	}
	c, err := gossh.Dial("tcp", "127.0.0.1:"+port, &gossh.ClientConfig{User: user, Auth: []gossh.AuthMethod{gossh.PublicKeys(signer)},
		HostKeyCallback: gossh.InsecureIgnoreHostKey(), Timeout: 20 * time.Second})
	if err != nil {
		t.Fatalf("login as %s: %v", user, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// TestSSHAuthorizedKeysOptions: each option with the real OpenSSH client.
func TestSSHAuthorizedKeysOptions(t *testing.T) {
	t.Parallel()
	forced, fromKey, expired, opener, restricted, unsupported := newLoginKey(t), newLoginKey(t), newLoginKey(t), newLoginKey(t), newLoginKey(t), newLoginKey(t)
	h := startRunnerWith(t, testenv.Busybox(t),
		"--ssh-authorized-key", `command="/bin/echo RESTRICTED $SSH_ORIGINAL_COMMAND",no-port-forwarding,no-pty `+forced.pub,
		"--ssh-authorized-key", `from="10.9.9.9" `+fromKey.pub,
		"--ssh-authorized-key", `expiry-time="20000101" `+expired.pub,
		"--ssh-authorized-key", `permitopen="127.0.0.1:9" `+opener.pub,
		"--ssh-authorized-key", `restrict `+restricted.pub,
		"--ssh-authorized-key", `cert-authority `+unsupported.pub)
	h.start(job("/bin/sh", "-c", "sleep 600"))
	port := h.sshPort

	out, code := openssh(t, port, forced, "root", "id -u")
	if code != 0 || strings.TrimSpace(out) != "RESTRICTED id -u" {
		t.Fatalf("command=: %d %q", code, out)
	}
	if out, code := openssh(t, port, forced, "root", "-o", "ExitOnForwardFailure=yes", "-N", "-R", "0:127.0.0.1:9", "true"); code == 0 {
		t.Fatalf("-R under no-port-forwarding: %q", out)
	}
	for name, k := range map[string]loginKey{"from= 10.9.9.9": fromKey, "expired": expired, "cert-authority (unsupported)": unsupported} {
		if out, code := openssh(t, port, k, "root", "echo in"); code != 255 || strings.Contains(out, "in\n") {
			t.Errorf("%s: %d %q", name, code, out)
		}
	}
	// permitopen: only 127.0.0.1:9 may be opened.
	c := goClient(t, port, opener, "root")
	if conn, err := c.Dial("tcp", "127.0.0.1:"+portOf(t, h)); err == nil {
		conn.Close()
		t.Fatal("permitopen allowed another destination")
	} else if !strings.Contains(err.Error(), "prohibited") && !strings.Contains(err.Error(), "not permitted") {
		t.Fatalf("permitopen refusal: %v", err)
	}
	// restrict: the pty request is refused (OpenSSH's -tt then gives up), no
	// forwarding; a plain command still runs.
	out, code = openssh(t, port, restricted, "root", "-tt", "tty || echo no-tty")
	if !strings.Contains(out, "PTY allocation request failed") {
		t.Fatalf("restrict gave a pty: %d %q", code, out)
	}
	if out, code := openssh(t, port, restricted, "root", "echo plain"); code != 0 || out != "plain\n" {
		t.Fatalf("restrict, plain command: %d %q", code, out)
	}
	rc := goClient(t, port, restricted, "root")
	if _, err := rc.Listen("tcp", "127.0.0.1:0"); err == nil {
		t.Fatal("restrict allowed -R")
	}
}

// TestSSHForwardsAsTheUser: forwards are opened with the login user's
// credentials. nobody cannot reach a socket in root's 0700 home, cannot
// create one there, cannot listen below 1024; -R binds loopback only; and
// nobody's /bin/false shell refuses sessions while forwarding still works.
func TestSSHForwardsAsTheUser(t *testing.T) {
	t.Parallel()
	key := newLoginKey(t)
	h := startRunnerWith(t, testenv.Busybox(t), "--ssh-authorized-key", key.pub)
	h.start(job("/bin/sh", "-c", "chmod 700 /root; sleep 600"))
	time.Sleep(300 * time.Millisecond) // the chmod
	port := h.sshPort

	// root creates a socket in its home through -R.
	root := goClient(t, port, key, "root")
	rootLn, err := root.ListenUnix("/root/rootonly.sock")
	if err != nil {
		t.Fatalf("root -R of a socket in /root: %v", err)
	}
	defer rootLn.Close()
	go func() {
		for {
			c, err := rootLn.Accept()
			if err != nil {
				return
			}
			_, _ = c.Write([]byte("secret\n"))
			c.Close()
		}
	}()
	// root can reach it back through -L.
	if conn, err := root.Dial("unix", "/root/rootonly.sock"); err != nil {
		t.Fatalf("root -L to its own socket: %v", err)
	} else {
		conn.Close()
	}

	nobody := goClient(t, port, key, "nobody")
	if conn, err := nobody.Dial("unix", "/root/rootonly.sock"); err == nil {
		conn.Close()
		t.Fatal("nobody reached a socket in root's 0700 home")
	} else if !strings.Contains(err.Error(), "Permission denied") {
		t.Fatalf("nobody -L: %v", err) // worded as OpenSSH does: connect failed: Permission denied
	}
	if ln, err := nobody.ListenUnix("/root/nobody.sock"); err == nil {
		ln.Close()
		t.Fatal("nobody created a socket in root's home")
	}
	if out, _ := testenv.Docker(context.Background(), "exec", h.container, "ls", "/root"); strings.Contains(out, "nobody.sock") {
		t.Fatal("a socket appeared in /root")
	}
	// A socket nobody may create is created as nobody.
	ln, err := nobody.ListenUnix("/tmp/nobody.sock")
	if err != nil {
		t.Fatalf("nobody -R to /tmp: %v", err)
	}
	out, _ := testenv.Docker(context.Background(), "exec", h.container, "ls", "-ln", "/tmp/nobody.sock")
	if f := strings.Fields(out); len(f) < 3 || f[2] != "65534" {
		t.Fatalf("socket owner: %q", out)
	}
	ln.Close()
	if _, err := nobody.Listen("tcp", "127.0.0.1:81"); err == nil {
		t.Fatal("nobody listened on a privileged port")
	}
	// -R on all interfaces binds loopback only (GatewayPorts no).
	rl, err := root.Listen("tcp", "0.0.0.0:0")
	if err != nil {
		t.Fatalf("root -R: %v", err)
	}
	defer rl.Close()
	_, rport, _ := net.SplitHostPort(rl.Addr().String())
	ssOut, _ := testenv.Docker(context.Background(), "exec", h.container, "cat", "/proc/net/tcp")
	if !strings.Contains(strings.ToUpper(ssOut), "0100007F:"+strings.ToUpper(hex4(rport))) {
		t.Fatalf("-R 0.0.0.0:%s is not bound to loopback:\n%s", rport, ssOut)
	}
	// nobody's shell is /bin/false: no session, as with OpenSSH.
	out, code := openssh(t, port, key, "nobody", "echo hi")
	if code != 1 || !strings.Contains(out, "This account is currently not available.") {
		t.Fatalf("nobody session: %d %q", code, out)
	}
}

func hex4(port string) string {
	var n int
	for _, c := range port {
		n = n*10 + int(c-'0')
	}
	const digits = "0123456789ABCDEF"
	return string([]byte{digits[n>>12&15], digits[n>>8&15], digits[n>>4&15], digits[n&15]})
}

// TestSSHSilentFlood: 300 connections that never speak do not lock a real
// login out; the oldest silent ones are dropped to make room.
func TestSSHSilentFlood(t *testing.T) {
	t.Parallel()
	key := newLoginKey(t)
	h := startRunnerWith(t, testenv.Busybox(t), "--ssh-authorized-key", key.pub)
	h.start(job("/bin/sh", "-c", "sleep 600"))
	var conns []net.Conn
	t.Cleanup(func() {
		for _, c := range conns {
			c.Close()
		}
	})
	for range 300 {
		c, err := net.Dial("tcp", "127.0.0.1:"+h.sshPort)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	time.Sleep(500 * time.Millisecond)
	start := time.Now()
	out, code := openssh(t, h.sshPort, key, "root", "echo logged-in")
	took := time.Since(start)
	if code != 0 || !strings.Contains(out, "logged-in") {
		t.Fatalf("login under a silent flood: %d %q", code, out)
	}
	t.Logf("real login with 300 silent connections open: %s", took.Round(time.Millisecond))
}
