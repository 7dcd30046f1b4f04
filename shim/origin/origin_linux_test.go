package origin

import (
	"net"
	"os"
	"os/exec"
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
