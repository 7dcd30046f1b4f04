package httpapi

import (
	"bufio"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tandem-run/tandem/common/rawnet"
)

// gated serves h through a gate with admit; returns the address and gate.
func gated(t *testing.T, h http.Handler, lim Limits, admit Admit) (string, *Gate) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := NewServer(h, lim)
	g := NewGate(ln, lim, admit, slog.New(slog.DiscardHandler))
	g.Attach(hs)
	go func() { _ = hs.Serve(g) }()
	t.Cleanup(func() { _ = hs.Close() })
	return ln.Addr().String(), g
}

// get sends one keep-alive GET on c and returns the status line.
func get(t *testing.T, c net.Conn, br *bufio.Reader) (string, error) {
	t.Helper()
	_ = c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := c.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n")); err != nil {
		return "", err
	}
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return "", err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.Status, nil
}

func ok(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, "ok") }

// When every slot holds an idle keep-alive connection, a newcomer is served
// at once and the longest idle one is closed for it.
func TestGateEvictsLongestIdleFirst(t *testing.T) {
	lim := DefaultLimits
	lim.MaxConns, lim.Reserve = 3, 0
	addr, g := gated(t, http.HandlerFunc(ok), lim, nil)
	var idle []net.Conn
	for range 3 {
		c := dial(t, addr)
		if st, err := get(t, c, bufio.NewReader(c)); err != nil || !strings.HasPrefix(st, "200") {
			t.Fatal(st, err)
		}
		idle = append(idle, c)
		time.Sleep(20 * time.Millisecond)
	}
	c4 := dial(t, addr)
	start := time.Now()
	if st, err := get(t, c4, bufio.NewReader(c4)); err != nil || !strings.HasPrefix(st, "200") {
		t.Fatalf("newcomer: %q %v", st, err)
	}
	// Without eviction it would wait for an idle timeout (90 s).
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("newcomer waited %s", d)
	}
	if !closedWithin(idle[0], 2*time.Second) {
		t.Fatal("the longest idle connection was not the one closed")
	}
	if closedWithin(idle[2], 100*time.Millisecond) {
		t.Fatal("the youngest idle connection was closed")
	}
	if s := g.Stats(); s.Evicted != 1 || s.Open != 3 {
		t.Fatalf("stats %+v", s)
	}
}

// Requests being served are never cut: a newcomer waits for one to end.
func TestGateNeverCutsServedRequests(t *testing.T) {
	lim := DefaultLimits
	lim.MaxConns, lim.Reserve = 2, 0
	release := make(chan struct{})
	var served atomic.Int32
	addr, _ := gated(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			<-release
		}
		served.Add(1)
		fmt.Fprint(w, "ok")
	}), lim, nil)
	var slow []net.Conn
	for range 2 {
		c := dial(t, addr)
		_, _ = c.Write([]byte("GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"))
		slow = append(slow, c)
	}
	time.Sleep(200 * time.Millisecond)
	c3 := dial(t, addr)
	_, _ = c3.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
	_ = c3.SetReadDeadline(time.Now().Add(400 * time.Millisecond))
	br := bufio.NewReader(c3)
	if _, err := br.ReadString('\n'); err == nil {
		t.Fatal("a connection past the cap was served while every slot served a request")
	}
	close(release)
	for _, c := range slow {
		_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
		if line, err := bufio.NewReader(c).ReadString('\n'); err != nil || !strings.Contains(line, "200") {
			t.Fatalf("a served request was cut: %q %v", line, err)
		}
		c.Close()
	}
	_ = c3.SetReadDeadline(time.Now().Add(3 * time.Second))
	if line, err := br.ReadString('\n'); err != nil || !strings.Contains(line, "200") {
		t.Fatalf("after a slot freed: %q %v", line, err)
	}
}

// A body that has been arriving for over a second may be cut for a
// newcomer; a fresh one is not.
func TestGateCutsTheOldestSlowBody(t *testing.T) {
	lim := DefaultLimits
	lim.MaxConns, lim.Reserve = 2, 0
	addr, _ := gated(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, err := io.ReadAll(r.Body)
		if err != nil {
			return
		}
		fmt.Fprint(w, "ok")
	}), lim, nil)
	var bodies []net.Conn
	for range 2 {
		c := dial(t, addr)
		_, _ = c.Write([]byte("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nabc"))
		bodies = append(bodies, c)
		time.Sleep(100 * time.Millisecond)
	}
	time.Sleep(bodyEvictAge)
	c3 := dial(t, addr)
	if st, err := get(t, c3, bufio.NewReader(c3)); err != nil || !strings.HasPrefix(st, "200") {
		t.Fatalf("newcomer: %q %v", st, err)
	}
	if !closedWithin(bodies[0], 2*time.Second) {
		t.Fatal("the oldest slow body was not cut")
	}
	if closedWithin(bodies[1], 100*time.Millisecond) {
		t.Fatal("a second slow body was cut for one newcomer")
	}
}

// Refused connections are answered 403 with the reason, never hold a
// slot, and the reserve is for trusted connections only.
func TestGateRefusesAtAcceptAndKeepsTheReserve(t *testing.T) {
	lim := DefaultLimits
	lim.MaxConns, lim.Reserve = 3, 1
	var mode atomic.Value // "refuse", "untrusted", "trusted"
	mode.Store("refuse")
	admit := func(conns []net.Conn) []Admission {
		out := make([]Admission, len(conns))
		for i := range conns {
			switch mode.Load() {
			case "refuse":
				out[i] = Admission{Refuse: true, Peer: "peer-x", Reason: "a container"}
			case "untrusted":
				out[i] = Admission{Peer: "u"}
			default:
				out[i] = Admission{Trusted: true, Peer: "t"}
			}
		}
		return out
	}
	addr, g := gated(t, http.HandlerFunc(ok), lim, admit)
	for range 20 {
		c := dial(t, addr)
		_, _ = c.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
		_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
		b, _ := io.ReadAll(c)
		if !strings.HasPrefix(string(b), "HTTP/1.1 403 ") || !strings.Contains(string(b), "not peer-x: a container") {
			t.Fatalf("refusal: %q", b)
		}
	}
	if s := g.Stats(); s.Refused != 20 || s.Open != 0 {
		t.Fatalf("refused connections held slots: %+v", s)
	}
	// Untrusted connections busy in requests fill the shared slots only.
	mode.Store("untrusted")
	release := make(chan struct{})
	defer close(release)
	addr2, g2 := gated(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/hold" {
			<-release
		}
		fmt.Fprint(w, "ok")
	}), lim, admit)
	for range 2 {
		c := dial(t, addr2)
		_, _ = c.Write([]byte("GET /hold HTTP/1.1\r\nHost: x\r\n\r\n"))
	}
	time.Sleep(200 * time.Millisecond)
	u := dial(t, addr2)
	_, _ = u.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
	_ = u.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if _, err := bufio.NewReader(u).ReadString('\n'); err == nil {
		t.Fatal("an untrusted connection took the reserved slot")
	}
	mode.Store("trusted")
	tc := dial(t, addr2)
	if st, err := get(t, tc, bufio.NewReader(tc)); err != nil || !strings.HasPrefix(st, "200") {
		t.Fatalf("a trusted connection did not get the reserve: %q %v (%+v)", st, err, g2.Stats())
	}
}

// TestGateServesOneClientsBurst: 64 connections of one client arriving at
// once at an idle gate are all served; the waiting-list share (16) sheds
// only what cannot get a slot. (Shedding before trying the free slots reset
// 48 of them.)
func TestGateServesOneClientsBurst(t *testing.T) {
	lim := DefaultLimits
	var calls atomic.Int64
	admit := func(conns []net.Conn) []Admission {
		if calls.Add(1) == 1 {
			time.Sleep(300 * time.Millisecond) // the rest pile up: one batch decides them
		}
		out := make([]Admission, len(conns))
		for i := range conns {
			out[i] = Admission{Trusted: true, Peer: "p", Key: "pid 1"}
		}
		return out
	}
	release := make(chan struct{})
	addr, g := gated(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-release // every request is in flight at once
		fmt.Fprint(w, "ok")
	}), lim, admit)
	const n = 64
	conns := make([]net.Conn, n)
	for i := range conns {
		conns[i] = dial(t, addr)
		_, _ = conns[i].Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
	}
	deadline := time.Now().Add(5 * time.Second)
	for g.Stats().Open < n && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	close(release)
	for i, c := range conns {
		if st, err := readStatus(c); err != nil || !strings.HasPrefix(st, "200") {
			t.Fatalf("connection %d: %q %v (%+v)", i, st, err, g.Stats())
		}
	}
	if s := g.Stats(); s.Shed != 0 {
		t.Fatalf("shed %d of one client's connections with slots free: %+v", s.Shed, s)
	}
}

func readStatus(c net.Conn) (string, error) {
	_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return "", err
	}
	resp.Body.Close()
	return resp.Status, nil
}

// Stats returns the counters.
func (g *Gate) Stats() GateStats {
	g.mu.Lock()
	defer g.mu.Unlock()
	s := g.stats
	s.Open = int64(g.used)
	return s
}

// The gate hands the server raw connections (common/rawnet: reads and
// writes that keep the scheduler's P, 120 -> 50-60 µs of the shim's CPU
// per GET on 2 vCPUs), and HTTP over them behaves as over net's own: a big
// response arrives whole through a socket that fills, and a client that
// goes away cancels its request's context (the server's background read).
func TestGateServesOverRawConnections(t *testing.T) {
	big := strings.Repeat("0123456789abcdef", 1<<16) // 1 MiB
	gone := make(chan struct{})
	addr, g := gated(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/wait" {
			<-r.Context().Done()
			close(gone)
			return
		}
		fmt.Fprint(w, big)
	}), DefaultLimits, nil)
	c := dial(t, addr)
	br := bufio.NewReader(c)
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte("GET /big HTTP/1.1\r\nHost: x\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond) // the server's writes fill the socket meanwhile
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || string(body) != big {
		t.Fatalf("big response: %d bytes, %v", len(body), err)
	}
	g.mu.Lock()
	for gc := range g.conns {
		if _, raw := gc.Conn.(*rawnet.Conn); !raw {
			t.Errorf("the gate handed the server a %T, not a raw connection", gc.Conn)
		}
	}
	g.mu.Unlock()
	if _, err := c.Write([]byte("GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	c.Close()
	select {
	case <-gone:
	case <-time.After(5 * time.Second):
		t.Fatal("the request's context outlived its client")
	}
}
