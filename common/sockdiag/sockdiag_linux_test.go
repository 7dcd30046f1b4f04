package sockdiag

import (
	"net"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"
)

func accepted(t testing.TB, ln net.Listener) net.Conn {
	t.Helper()
	_ = ln.(*net.TCPListener).SetDeadline(time.Now().Add(10 * time.Second))
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// TestDiagAgreesWithScan: the netlink lookup and the /proc scan find the
// same socket.
func TestDiagAgreesWithScan(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	cl, _ := net.Dial("tcp", ln.Addr().String())
	defer cl.Close()
	c := accepted(t, ln)
	l, r := c.LocalAddr().(*net.TCPAddr), c.RemoteAddr().(*net.TCPAddr)
	look := Open("")
	defer look.Close()
	if look.fd < 0 {
		t.Fatal("no netlink socket")
	}
	a, ua, err1 := diagInode(look.fd, 1, r, l)
	b, ub, err2 := scanInode("/proc", l, r)
	if err1 != nil || err2 != nil || a != b || a == 0 || ua != ub || ua != uint32(os.Geteuid()) {
		t.Fatalf("diag %d uid %d %v, scan %d uid %d %v", a, ua, err1, b, ub, err2)
	}
	if _, _, err := diagInode(look.fd, 2, &net.TCPAddr{IP: r.IP, Port: 1}, l); err == nil {
		t.Fatal("a tuple with no socket was found")
	}
	// The socket answers again after a miss (answers matched by sequence).
	if a2, _, err := diagInode(look.fd, 3, r, l); err != nil || a2 != a {
		t.Fatalf("after a miss: %d %v", a2, err)
	}
}

func TestAddrIs(t *testing.T) {
	a := &net.TCPAddr{IP: net.ParseIP("127.0.0.1"), Port: 8080}
	if !addrIs("0100007F:1F90", a) || addrIs("0100007F:1F91", a) || addrIs("0200007F:1F90", a) {
		t.Fatal("ipv4")
	}
	// ::ffff:127.0.0.1 as a tcp6 entry.
	if !addrIs("0000000000000000FFFF00000100007F:1F90", a) {
		t.Fatal("v4-mapped")
	}
}

// TestOwnerUID: a client that runs as another uid is reported with that
// uid by both lookups.
func TestOwnerUID(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to run a client as nobody")
	}
	bb, err := exec.LookPath("busybox")
	if err != nil {
		t.Skip("busybox missing")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	cmd := exec.Command(bb, "nc", "127.0.0.1", port)
	stdin, _ := cmd.StdinPipe()
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		stdin.Close()
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = cmd.Wait()
	})
	c := accepted(t, ln)
	l, r := c.LocalAddr().(*net.TCPAddr), c.RemoteAddr().(*net.TCPAddr)
	look := Open("")
	defer look.Close()
	if _, uid, err := look.Find(l, r); err != nil || uid != 65534 {
		t.Fatalf("diag: uid %d %v", uid, err)
	}
	if _, uid, err := scanInode("/proc", l, r); err != nil || uid != 65534 {
		t.Fatalf("scan: uid %d %v", uid, err)
	}
}
