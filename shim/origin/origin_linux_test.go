package origin

import (
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
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

func TestSameProcessIsFromHost(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	cl, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	c := accepted(t, ln)
	v := Checker{}.Check(c.LocalAddr(), c.RemoteAddr())
	if !v.FromHost || !strings.Contains(v.Peer, "pid "+strconv.Itoa(os.Getpid())) {
		t.Fatalf("%+v", v)
	}
}

// namespacedClient connects to ln's port from busybox nc in its own mount
// namespace (what every container has), on the same loopback; it lives as
// long as the test.
func namespacedClient(t *testing.T, ln net.Listener) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("unshare needs root")
	}
	bb, err := exec.LookPath("busybox")
	if err != nil {
		t.Skip("busybox missing")
	}
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	cmd := exec.Command("unshare", "--mount", bb, "nc", "127.0.0.1", port)
	stdin, _ := cmd.StdinPipe()
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		stdin.Close()
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = cmd.Wait()
	})
}

// TestOtherMountNamespaceIsNot: a client in its own mount namespace, on the
// same loopback, is not the host.
func TestOtherMountNamespaceIsNot(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	namespacedClient(t, ln)
	c := accepted(t, ln)
	v := Checker{}.Check(c.LocalAddr(), c.RemoteAddr())
	if v.FromHost || !strings.Contains(v.Reason, "another mount namespace") || !strings.Contains(v.Peer, "nc") && !strings.Contains(v.Peer, "busybox") {
		t.Fatalf("%+v", v)
	}
}

// TestCheckBatchMixesHostAndNamespaced: one batch of connections from this
// process and from a client in its own mount namespace gets each verdict
// right, with one walk.
func TestCheckBatchMixesHostAndNamespaced(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var pairs []Pair
	var want []bool
	for i := range 40 {
		if i%4 == 3 {
			namespacedClient(t, ln)
			want = append(want, false)
		} else {
			cl, err := net.Dial("tcp", ln.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { cl.Close() })
			want = append(want, true)
		}
		c := accepted(t, ln)
		pairs = append(pairs, Pair{Local: c.LocalAddr(), Remote: c.RemoteAddr()})
	}
	// A connection whose client is gone (closed before the check) and a
	// pair that is not TCP are refused, not mistaken.
	gone, _ := net.Dial("tcp", ln.Addr().String())
	gc := accepted(t, ln)
	gone.Close()
	time.Sleep(50 * time.Millisecond)
	pairs = append(pairs, Pair{Local: gc.LocalAddr(), Remote: gc.RemoteAddr()}, Pair{Local: &net.UnixAddr{}, Remote: &net.UnixAddr{Name: "x"}})
	want = append(want, false, false)
	got := Checker{}.CheckBatch(pairs)
	for i, v := range got {
		if v.FromHost != want[i] {
			t.Errorf("pair %d: want from host %v, got %+v", i, want[i], v)
		}
		if !v.FromHost && v.Reason == "" {
			t.Errorf("pair %d: a refusal without a reason: %+v", i, v)
		}
	}
}

// BenchmarkCheck is the cost per new connection (once per connection,
// cached for its keep-alive requests).
func BenchmarkCheck(b *testing.B) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	cl, _ := net.Dial("tcp", ln.Addr().String())
	defer cl.Close()
	c := accepted(b, ln)
	b.ResetTimer()
	for range b.N {
		if v := (Checker{}).Check(c.LocalAddr(), c.RemoteAddr()); !v.FromHost {
			b.Fatal(v)
		}
	}
}

// heldBy connects to ln from this process, hands a copy of the client's
// socket to sleep started with attr (another uid, another mount namespace:
// what SCM_RIGHTS gives a process just as inheritance does), and, when
// keep is false, closes this process's copy, so the child alone holds it.
func heldBy(t *testing.T, ln net.Listener, keep bool, argv []string, attr *syscall.SysProcAttr) net.Conn {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("another uid or mount namespace needs root")
	}
	cl, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	f, err := cl.(*net.TCPConn).File()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.ExtraFiles = []*os.File{f}
	attr.Setpgid = true
	cmd.SysProcAttr = attr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = cmd.Wait()
	})
	// The holder is in place once sleep runs: unshare makes its namespace
	// and then execs it (checked before that, it was still the host's).
	comm := filepath.Join("/proc", strconv.Itoa(cmd.Process.Pid), "comm")
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if b, _ := os.ReadFile(comm); strings.TrimSpace(string(b)) == "sleep" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%q did not become sleep", argv)
		}
	}
	f.Close()
	if keep {
		t.Cleanup(func() { cl.Close() })
	} else {
		cl.Close()
	}
	return accepted(t, ln)
}

// TestPassedSocketCountsEveryHolder (issue 64, hole 2): the uid that made
// a socket is not who holds it. A socket root made and handed to an
// ordinary account carries that account's uid too, and one that a
// container's process also holds is not the host's.
func TestPassedSocketCountsEveryHolder(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()

	c := heldBy(t, ln, false, []string{"sleep", "30"}, &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}})
	v := Checker{}.Check(c.LocalAddr(), c.RemoteAddr())
	if !v.FromHost || !slices.Contains(v.UIDs, 0) || !slices.Contains(v.UIDs, 65534) || !strings.Contains(v.Peer, "uid 65534") {
		t.Fatalf("root's socket held by nobody: %+v", v)
	}

	c = heldBy(t, ln, true, []string{"unshare", "--mount", "sleep", "30"}, &syscall.SysProcAttr{})
	v = Checker{}.Check(c.LocalAddr(), c.RemoteAddr())
	if v.FromHost || !strings.Contains(v.Reason, "a process holding the client socket") {
		t.Fatalf("a socket a container also holds: %+v", v)
	}
}

// TestHolderUIDs reads all four uids of a set-uid-like holder: a program
// whose effective uid differs from its real one counts as both.
func TestHolderUIDs(t *testing.T) {
	dir := t.TempDir()
	pid := filepath.Join(dir, "7")
	if err := os.MkdirAll(pid, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(pid, "status"), []byte("Name:\tpasswd\nUmask:\t0022\nUid:\t1000\t0\t0\t0\nGid:\t1000\t1000\t1000\t1000\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	h, err := Checker{Proc: dir}.readHolder(7)
	if err != nil || h.comm != "passwd" || h.uids != [4]uint32{1000, 0, 0, 0} {
		t.Fatalf("%+v %v", h, err)
	}
	if err := os.WriteFile(filepath.Join(pid, "status"), []byte("Name:\tx\nUid:\t0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := (Checker{Proc: dir}).readHolder(7); err == nil {
		t.Fatal("a short Uid line was taken")
	}
}
