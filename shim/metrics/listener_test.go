package metrics

import (
	"bufio"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"
)

// listening serves a stand-in /metrics on a loopback port through Listen.
func listening(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := Listen(ln, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "tandem_shim_up 1\n")
	}), slog.New(slog.DiscardHandler))
	t.Cleanup(func() { _ = l.Close() })
	return l.Addr().String()
}

// hold opens n connections from 127.0.0.1 and sends each first (whole
// requests: keep-alive connections once answered; a request line cut
// short: a slow sender).
func hold(t *testing.T, addr string, n int, first string) []net.Conn {
	t.Helper()
	conns := make([]net.Conn, 0, n)
	for range n {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		if _, err := io.WriteString(c, first); err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	return conns
}

// answered reads one answer off each connection (closed ones give none).
func answered(conns []net.Conn) {
	for _, c := range conns {
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if resp, err := http.ReadResponse(bufio.NewReader(c), nil); err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		_ = c.SetReadDeadline(time.Time{})
	}
}

// stillOpen counts the connections the listener has not closed.
func stillOpen(t *testing.T, conns []net.Conn) int {
	t.Helper()
	open := 0
	for _, c := range conns {
		_ = c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		_, err := c.Read(make([]byte, 1))
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			open++
		}
	}
	return open
}

// scrapeFrom GETs /metrics from the source address src on a connection
// of its own, giving up after 10 s.
func scrapeFrom(t *testing.T, src, addr string) (int, string, error) {
	t.Helper()
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DialContext: d.DialContext, DisableKeepAlives: true}}
	resp, err := c.Get("http://" + addr + "/metrics")
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// TestListenerScrapesGetThroughHeldConnections: one peer opening more
// connections than the listener has slots (asking for keep-alive, or
// sending its request line a byte at a time) keeps neither another
// scraper nor itself out: a kept-alive connection is closed once
// answered, and a new scrape closes one still sending its request line.
func TestListenerScrapesGetThroughHeldConnections(t *testing.T) {
	for _, tc := range []struct{ name, first string }{
		{"kept alive", "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n"},
		{"slow request line", "GET /metr"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addr := listening(t)
			conns := hold(t, addr, 2*ListenerConns, tc.first)
			if strings.HasSuffix(tc.first, "\r\n\r\n") {
				answered(conns)
			}
			code, body, err := scrapeFrom(t, "127.0.0.2", addr)
			if err != nil || code != http.StatusOK || body != "tandem_shim_up 1\n" {
				t.Fatalf("scrape beside %d held connections: %d %q %v", len(conns), code, body, err)
			}
			if !strings.HasSuffix(tc.first, "\r\n\r\n") {
				return // a slow sender's connections wait for a slot, holding none
			}
			if open := stillOpen(t, conns); open > ListenerConns/4 {
				t.Fatalf("the holder keeps %d connections open, its share is %d", open, ListenerConns/4)
			}
		})
	}
}

// TestListenerServesOneRequestPerConnection: pipelined requests get one
// answer, which says the connection closes, and then its end.
func TestListenerServesOneRequestPerConnection(t *testing.T) {
	addr := listening(t)
	req := "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
	c := hold(t, addr, 1, strings.Repeat(req, 100))[0]
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	b, err := io.ReadAll(c)
	if err != nil && !strings.Contains(err.Error(), "reset") {
		t.Fatalf("read: %v (%q)", err, b)
	}
	if n := strings.Count(string(b), "HTTP/1.1 200 "); n != 1 || !strings.Contains(string(b), "Connection: close") {
		t.Fatalf("%d answers to 100 pipelined requests: %q", n, b)
	}
}

// TestListenerRefusesBodies: a request with a body is answered 400 and
// its connection closed without the body being read (it would hold the
// connection busy for as long as the client trickles it).
func TestListenerRefusesBodies(t *testing.T) {
	addr := listening(t)
	c := hold(t, addr, 1, "GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nabc")[0]
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	b, err := io.ReadAll(c)
	if err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
		// A reset after the answer is a close too.
		if !errors.Is(err, net.ErrClosed) && !strings.Contains(err.Error(), "reset") {
			t.Fatalf("read: %v", err)
		}
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the connection stayed open for the rest of the body: %q", b)
	}
	if !strings.HasPrefix(string(b), "HTTP/1.1 400 ") || !strings.Contains(string(b), "a scrape has no request body") {
		t.Fatalf("answer: %q", b)
	}
}

// TestListenerServesOnlyMetrics: the listener answers GET /metrics and
// nothing else.
func TestListenerServesOnlyMetrics(t *testing.T) {
	addr := listening(t)
	for path, want := range map[string]int{"/metrics": 200, "/api/tasks": 404, "/metrics/tasks/x": 404} {
		req, _ := http.NewRequestWithContext(context.Background(), http.MethodGet, "http://"+addr+path, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("GET %s: %d, want %d", path, resp.StatusCode, want)
		}
	}
}

func TestPeerKey(t *testing.T) {
	for addr, want := range map[string]string{
		"127.0.0.1:80":               "127.0.0.1",
		"127.8.9.10:80":              "127.8.9.10",
		"[::1]:80":                   "::1",
		"[::ffff:127.0.0.2]:80":      "127.0.0.2",
		"10.1.2.3:5000":              "10.1.2.3",
		"[::ffff:10.1.2.3]:5000":     "10.1.2.3",
		"[2001:db8:1:2:3:4:5:6]:443": "2001:db8:1:2::/64",
		"[2001:db8:1:2::9]:443":      "2001:db8:1:2::/64",
		"[fe80::1%eth0]:443":         "fe80::/64",
	} {
		ap, err := net.ResolveTCPAddr("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		if got := PeerKey(ap); got != want {
			t.Errorf("PeerKey(%s) = %q, want %q", addr, got, want)
		}
	}
}
