package httpapi

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

func serve(t *testing.T, h http.Handler, lim Limits) string {
	t.Helper()
	addr, _ := gated(t, h, lim, nil)
	return addr
}

func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// closedWithin reports whether the server closed c within d.
func closedWithin(c net.Conn, d time.Duration) bool {
	_ = c.SetReadDeadline(time.Now().Add(d))
	_, err := io.Copy(io.Discard, c)
	return err == nil // EOF: closed by the server; a timeout: still open
}

func TestIdleAndSlowClientsAreCut(t *testing.T) {
	lim := DefaultLimits
	lim.IdleTimeout, lim.ReadHeaderTimeout = 200*time.Millisecond, 200*time.Millisecond
	lim.BodyIdle, lim.BodyGrace, lim.MinBodyRate = 200*time.Millisecond, 300*time.Millisecond, 1000
	gotErr := make(chan error, 4)
	addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, err := io.ReadAll(r.Body)
		gotErr <- err
	}), lim)

	t.Run("idle before any request", func(t *testing.T) {
		if !closedWithin(dial(t, addr), 3*time.Second) {
			t.Fatal("idle connection kept open")
		}
	})
	t.Run("headers that never end", func(t *testing.T) {
		c := dial(t, addr)
		_, _ = c.Write([]byte("POST / HTTP/1.1\r\nHost: x\r\n"))
		if !closedWithin(c, 3*time.Second) {
			t.Fatal("slow headers kept open")
		}
	})
	t.Run("body that stalls", func(t *testing.T) {
		c := dial(t, addr)
		_, _ = c.Write([]byte("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc"))
		if !closedWithin(c, 3*time.Second) {
			t.Fatal("stalled body kept open")
		}
		if err := <-gotErr; err == nil {
			t.Fatal("handler read a stalled body without error")
		}
	})
	t.Run("body that trickles", func(t *testing.T) {
		c := dial(t, addr)
		_, _ = c.Write([]byte("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"))
		// One byte every 100 ms never stalls BodyIdle but stays far under
		// MinBodyRate: cut once the grace is over.
		start := time.Now()
		for time.Since(start) < 3*time.Second {
			if _, err := c.Write([]byte("x")); err != nil {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		select {
		case err := <-gotErr:
			if err == nil {
				t.Fatal("handler read a trickling body without error")
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("a trickling body was never cut (%s)", time.Since(start))
		}
	})
}

// TestLongHandlerKeepsItsContext: after the body is read the server watches
// the connection in the background; a deadline left over from the body must
// not cancel a handler that works longer than BodyIdle.
func TestLongHandlerKeepsItsContext(t *testing.T) {
	lim := DefaultLimits
	lim.BodyIdle, lim.BodyGrace = 100*time.Millisecond, 100*time.Millisecond
	addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body)
		select {
		case <-time.After(500 * time.Millisecond):
			fmt.Fprint(w, "done")
		case <-r.Context().Done():
			http.Error(w, "cancelled", 500)
		}
	}), lim)
	resp, err := http.Post("http://"+addr+"/", "application/json", strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if string(b) != "done" {
		t.Fatalf("handler saw %q", b)
	}
	// The connection is reused for a second request.
	resp2, err := http.Post("http://"+addr+"/", "application/json", strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	resp2.Body.Close()
}
