package testenv

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// SSHD is a real OpenSSH server on a loopback port with its own host key,
// accepting one client key for the current user.
type SSHD struct {
	Addr       string // 127.0.0.1:port
	User       string
	ClientKey  string // private key file for the client
	KnownHosts string // known_hosts file with the server's ed25519 key only
	HostPub    string // the host's ed25519 public key line
	// OtherHostPubs are the host's ECDSA and RSA key lines: like most
	// hosts it has several, and known_hosts after one `ssh` holds one.
	OtherHostPubs []string
}

// StartSSHD runs /usr/sbin/sshd -D with a private config (Debian package
// openssh-server); it stops with the test.
func StartSSHD(t testing.TB) *SSHD {
	t.Helper()
	return StartSSHDAt(t, FreeAddr(t), nil)
}

// StartSSHDAt is StartSSHD listening on addr, started through wrap (e.g.
// a Host's Wrap, to run inside its network namespace).
func StartSSHDAt(t testing.TB, addr string, wrap []string) *SSHD {
	t.Helper()
	if os.Geteuid() != 0 {
		if InCI() {
			t.Fatal("sshd tests need root (CI runs as root)")
		}
		t.Skip("sshd tests need root")
	}
	if _, err := os.Stat("/usr/sbin/sshd"); err != nil {
		t.Fatalf("sshd missing (install openssh-server; make deps does): %v", err)
	}
	dir := t.TempDir()
	keygen := func(path, typ string) { KeyGen(t, path, typ) }
	hostKey, clientKey := filepath.Join(dir, "host_key"), filepath.Join(dir, "client_key")
	keygen(hostKey, "ed25519")
	keygen(clientKey, "ed25519")
	// RSA first in the config; a client offering RSA first gets that one.
	others := []string{filepath.Join(dir, "host_key_rsa"), filepath.Join(dir, "host_key_ecdsa")}
	keygen(others[0], "rsa")
	keygen(others[1], "ecdsa")
	pub, _ := os.ReadFile(clientKey + ".pub")
	ak := filepath.Join(dir, "authorized_keys")
	if err := os.WriteFile(ak, pub, 0o600); err != nil {
		t.Fatal(err)
	}
	_ = os.MkdirAll("/run/sshd", 0o755)
	s := &SSHD{Addr: addr, User: "root", ClientKey: clientKey}
	host, port, _ := net.SplitHostPort(s.Addr)
	cfg := fmt.Sprintf(`Port %s
ListenAddress %s
HostKey %s
HostKey %s
HostKey %s
AuthorizedKeysFile %s
PidFile none
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
AllowTcpForwarding yes
StrictModes no
LogLevel ERROR
`, port, host, others[0], others[1], hostKey, ak)
	cfgPath := filepath.Join(dir, "sshd_config")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	argv := append(append([]string{}, wrap...), "/usr/sbin/sshd", "-D", "-e", "-f", cfgPath)
	cmd := exec.Command(argv[0], argv[1:]...)
	logf, _ := os.Create(filepath.Join(dir, "sshd.log"))
	cmd.Stdout, cmd.Stderr = logf, logf
	t.Cleanup(func() { logf.Close() })
	StartDaemon(t, cmd) // sshd forks per connection: killed as a group
	hostPub, _ := os.ReadFile(hostKey + ".pub")
	f := strings.Fields(string(hostPub))
	s.HostPub = f[0] + " " + f[1]
	for _, k := range others {
		b, _ := os.ReadFile(k + ".pub")
		f := strings.Fields(string(b))
		s.OtherHostPubs = append(s.OtherHostPubs, f[0]+" "+f[1])
	}
	s.KnownHosts = filepath.Join(dir, "known_hosts")
	if err := os.WriteFile(s.KnownHosts, []byte(fmt.Sprintf("[%s]:%s %s\n", host, port, s.HostPub)), 0o644); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := net.Dial("tcp", s.Addr)
		if err == nil {
			c.Close()
			return s
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(filepath.Join(dir, "sshd.log"))
			t.Fatalf("sshd did not listen: %s", b)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// KeyGen writes an unencrypted SSH key pair of type typ (ed25519, rsa,
// ecdsa) at path and path.pub, and returns the public key's line.
func KeyGen(t testing.TB, path, typ string) string {
	t.Helper()
	if out, err := exec.Command("ssh-keygen", "-q", "-t", typ, "-N", "", "-f", path).CombinedOutput(); err != nil {
		t.Fatalf("ssh-keygen: %v %s", err, out)
	}
	pub, err := os.ReadFile(path + ".pub")
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(pub))
}
