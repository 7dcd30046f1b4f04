package portfwd

import (
	"io"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/logging"
)

// echoServer stands in for the runner: it echoes each connection.
func echoServer(t *testing.T) (string, int) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c); c.Close() }()
		}
	}()
	return "127.0.0.1", ln.Addr().(*net.TCPAddr).Port
}

func roundTrip(t *testing.T, port int, msg string) (string, error) {
	t.Helper()
	c, err := net.Dial("tcp", "127.0.0.1:"+strconv.Itoa(port))
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, msg); err != nil {
		return "", err
	}
	_ = c.(*net.TCPConn).CloseWrite()
	b, err := io.ReadAll(c)
	return string(b), err
}

// TestForwardAdmitsAndRefuses: an admitted connection reaches the
// container's port both ways; a refused one reads the reason and never
// reaches it; Close ends listeners and open connections; a re-open keeps
// the host port the server was told.
func TestForwardAdmitsAndRefuses(t *testing.T) {
	ip, port := echoServer(t)
	var refuse atomic.Bool
	f := New(func(net.Conn) (bool, string) {
		if !refuse.Load() {
			return true, ""
		}
		return false, "uid 1000 (bob) is not root-equivalent"
	}, logging.Discard())
	ports, err := f.Open("t1", ip, []int{port}, nil)
	if err != nil || len(ports) != 1 || ports[0].Container != port || ports[0].Host == 0 {
		t.Fatalf("%v %v", ports, err)
	}
	if got, err := roundTrip(t, ports[0].Host, "hello"); err != nil || got != "hello" {
		t.Fatalf("admitted: %q %v", got, err)
	}
	refuse.Store(true)
	if got, _ := roundTrip(t, ports[0].Host, "GET / HTTP/1.1\r\n\r\n"); !strings.Contains(got, "403") || !strings.Contains(got, "not root-equivalent") || strings.Contains(got, "GET /") {
		t.Fatalf("refused: %q", got)
	}
	refuse.Store(false)
	// An open connection is cut when the task's forwards close.
	c, err := net.Dial("tcp", "127.0.0.1:"+strconv.Itoa(ports[0].Host))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, "x"); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 1)
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(c, b); err != nil {
		t.Fatal(err)
	}
	f.Close("t1")
	if _, err := c.Read(b); err == nil {
		t.Fatal("the connection outlived its task's forwards")
	}
	if _, err := net.Dial("tcp", "127.0.0.1:"+strconv.Itoa(ports[0].Host)); err == nil {
		t.Fatal("the listener outlived Close")
	}
	again, err := f.Open("t1", ip, []int{port}, []api.PortMapping{{Host: ports[0].Host, Container: port}})
	if err != nil || again[0].Host != ports[0].Host {
		t.Fatalf("re-open on the recorded port: %v %v", again, err)
	}
	f.CloseAll()
	if f.Ports("t1") != nil {
		t.Fatal("CloseAll left forwards")
	}
}

// TestForwardBoundsConnections: past MaxConns a connection is closed at
// once, and the bound frees as connections end.
func TestForwardBoundsConnections(t *testing.T) {
	ip, port := echoServer(t)
	f := New(func(net.Conn) (bool, string) { return true, "" }, logging.Discard())
	f.MaxConns = 2
	ports, err := f.Open("t", ip, []int{port}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer f.CloseAll()
	addr := "127.0.0.1:" + strconv.Itoa(ports[0].Host)
	var held []net.Conn
	for range 2 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_, _ = io.WriteString(c, "x")
		b := make([]byte, 1)
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.ReadFull(c, b); err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	if got, _ := roundTrip(t, ports[0].Host, "y"); got != "" {
		t.Fatalf("a connection past the bound was served: %q", got)
	}
	held[0].Close()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		if got, _ := roundTrip(t, ports[0].Host, "z"); got == "z" {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatal("the bound did not free")
}
