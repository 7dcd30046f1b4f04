package transport

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tandem-run/tandem/common/deadlineconn"
)

// leanServer is an agent stand-in that counts the connections it accepted
// and the POSTs it served.
type leanServer struct {
	*httptest.Server
	conns, posts atomic.Int64
}

func newLeanServer(t *testing.T, h http.HandlerFunc) *leanServer {
	t.Helper()
	return newLeanServerOn(t, nil, h)
}

// newLeanServerOn serves on ln (nil: a loopback TCP port).
func newLeanServerOn(t *testing.T, ln net.Listener, h http.HandlerFunc) *leanServer {
	t.Helper()
	s := &leanServer{}
	s.Server = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			s.posts.Add(1)
		}
		h(w, r)
	}))
	if ln != nil {
		s.Listener.Close()
		s.Listener = ln
	}
	s.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			s.conns.Add(1)
		}
	}
	s.Start()
	t.Cleanup(s.Close)
	return s
}

func leanClient(t *testing.T, url string) *Client {
	t.Helper()
	c, err := New(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.HTTP.CloseIdleConnections)
	return c
}

// channelClient is a client of the agent at addr whose connections are
// not sockets, as ctl.Tunnel's SSH channels are not.
func channelClient(t *testing.T, addr string) *Client {
	t.Helper()
	var d net.Dialer
	c, err := NewWithDialer(addr, func(ctx context.Context, network, addr string) (net.Conn, error) {
		nc, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return deadlineconn.Wrap(nc), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.HTTP.CloseIdleConnections)
	return c
}

// rawAgent serves each connection with serve, below HTTP: for answers
// net/http's server would not give.
func rawAgent(t *testing.T, serve func(net.Conn)) string {
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
			go func() {
				defer c.Close()
				serve(c)
			}()
		}
	}()
	return ln.Addr().String()
}

func jsonOK(w http.ResponseWriter, body string) {
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprint(w, body)
}

// Calls one after another, answered with a length or chunked, share one
// connection; 64 at once open at most 64 and every answer is its own call's.
func TestLeanKeepsConnections(t *testing.T) {
	s := newLeanServer(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("chunked") != "" {
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprint(w, `{"id":"`)
			w.(http.Flusher).Flush()
			fmt.Fprintf(w, `%s"}`, r.URL.Query().Get("id"))
			return
		}
		jsonOK(w, fmt.Sprintf(`{"id":%q}`, r.URL.Query().Get("id")))
	})
	c := leanClient(t, s.URL)
	ctx := context.Background()
	for i := range 20 {
		var out struct{ ID string }
		path := fmt.Sprintf("/x?id=%d", i)
		if i%2 == 1 {
			path += "&chunked=1"
		}
		if err := c.JSON(ctx, Request{Method: http.MethodGet, Path: path}, &out); err != nil || out.ID != fmt.Sprint(i) {
			t.Fatalf("call %d: %+v %v", i, out, err)
		}
	}
	// A POST with a JSON body rides the same connection.
	if err := c.JSON(ctx, Request{Method: http.MethodPost, Path: "/x?id=p", JSON: map[string]int{"a": 1}}, nil); err != nil {
		t.Fatal(err)
	}
	if n := s.conns.Load(); n != 1 {
		t.Fatalf("21 calls in a row opened %d connections, want 1", n)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 64*10)
	for g := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 10 {
				id := fmt.Sprintf("%d-%d", g, i)
				var out struct{ ID string }
				if err := c.JSON(ctx, Request{Method: http.MethodGet, Path: "/x?id=" + id}, &out); err != nil || out.ID != id {
					errs <- fmt.Errorf("%s: %+v %v", id, out, err)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if n := s.conns.Load(); n > 65 {
		t.Fatalf("64 concurrent callers opened %d connections", n)
	}
}

// The agent closes kept connections (its idle limit): a GET is sent again
// on a new one; a POST is never sent twice: the closed connection is found
// before it is sent.
func TestLeanAgentClosedIdleConnection(t *testing.T) {
	s := newLeanServer(t, func(w http.ResponseWriter, r *http.Request) { jsonOK(w, `{}`) })
	c := leanClient(t, s.URL)
	ctx := context.Background()
	for _, m := range []string{http.MethodGet, http.MethodPost, http.MethodGet} {
		if err := c.JSON(ctx, Request{Method: m, Path: "/x", JSON: map[string]int{}}, nil); err != nil {
			t.Fatalf("%s before the close: %v", m, err)
		}
		s.CloseClientConnections()
		time.Sleep(20 * time.Millisecond) // the FIN reaches the client
		if err := c.JSON(ctx, Request{Method: m, Path: "/x", JSON: map[string]int{}}, nil); err != nil {
			t.Fatalf("%s after the agent closed the kept connection: %v", m, err)
		}
	}
	if n := s.posts.Load(); n != 2 {
		t.Fatalf("the agent saw %d POSTs, want 2", n)
	}
}

// A call cut by its context ends with the context's error, fast; the
// connection it held is not reused for the next call.
func TestLeanContextEndsCall(t *testing.T) {
	release := make(chan struct{})
	s := newLeanServer(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow-head" {
			<-release
		}
		if r.URL.Path == "/slow-body" {
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprint(w, `{"id":`)
			w.(http.Flusher).Flush()
			<-release
		}
		jsonOK(w, `{"id":"ok"}`)
	})
	t.Cleanup(func() { close(release) })
	c := leanClient(t, s.URL)
	for _, path := range []string{"/slow-head", "/slow-body"} {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		began := time.Now()
		err := c.JSON(ctx, Request{Method: http.MethodGet, Path: path}, &struct{}{})
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) || !IsTimeout(err) {
			t.Fatalf("%s past its deadline: %v", path, err)
		}
		if d := time.Since(began); d > 2*time.Second {
			t.Fatalf("%s took %v to end after a 100 ms deadline", path, d)
		}
		ctx, cancel = context.WithCancel(context.Background())
		time.AfterFunc(50*time.Millisecond, cancel)
		err = c.JSON(ctx, Request{Method: http.MethodGet, Path: path}, &struct{}{})
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("%s cancelled: %v", path, err)
		}
	}
	before := s.conns.Load()
	var out struct{ ID string }
	if err := c.JSON(context.Background(), Request{Method: http.MethodGet, Path: "/fast"}, &out); err != nil || out.ID != "ok" {
		t.Fatalf("the call after: %+v %v", out, err)
	}
	if s.conns.Load() != before+1 {
		t.Fatal("a connection left mid-answer by a cut call was reused")
	}
}

// A body closed before its end: what already arrived is drained and the
// connection kept; a body still streaming closes its connection, and
// Close does not wait for the rest. Close from another goroutine ends a
// blocked Read.
func TestLeanEarlyClose(t *testing.T) {
	release := make(chan struct{})
	s := newLeanServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, strings.Repeat(" ", 1000)+`{}`)
		if r.URL.Path == "/endless" {
			w.(http.Flusher).Flush()
			<-release
		}
	})
	t.Cleanup(func() { close(release) })
	c := leanClient(t, s.URL)
	ctx := context.Background()
	get := func(path string) *http.Response {
		resp, cancel, err := c.Do(ctx, Request{Method: http.MethodGet, Path: path})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(cancel)
		return resp
	}
	resp := get("/short")
	if _, err := io.ReadFull(resp.Body, make([]byte, 10)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond) // the rest is in
	resp.Body.Close()
	get("/short").Body.Close()
	if n := s.conns.Load(); n != 1 {
		t.Fatalf("bodies closed with their rest received opened %d connections, want 1", n)
	}
	resp = get("/endless")
	if _, err := io.ReadFull(resp.Body, make([]byte, 10)); err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	resp.Body.Close()
	if d := time.Since(began); d > time.Second {
		t.Fatalf("Close waited %v for a body still streaming", d)
	}
	resp = get("/endless")
	readErr := make(chan error, 1)
	go func() {
		_, err := io.Copy(io.Discard, resp.Body)
		readErr <- err
	}()
	time.Sleep(50 * time.Millisecond)
	resp.Body.Close()
	select {
	case err := <-readErr:
		if err == nil {
			t.Fatal("a Read cut by Close reported a whole body")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not end a blocked Read")
	}
	// The first endless answer took the kept connection, the second a new
	// one; neither is kept, so this call opens a third.
	get("/short").Body.Close()
	if n := s.conns.Load(); n != 3 {
		t.Fatalf("%d connections, want 3 (the streaming ones not reused)", n)
	}
}

// An answer that asks to close, or one with stray bytes after its end,
// does not leave its connection in the pool.
func TestLeanDoesNotKeepSpentConnections(t *testing.T) {
	var accepted atomic.Int64
	answers := []string{
		"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
		"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n{\"x\":666}",
		"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
	}
	addr := rawAgent(t, func(c net.Conn) {
		i := accepted.Add(1) - 1
		buf := make([]byte, 4096)
		for {
			if _, err := c.Read(buf); err != nil {
				return
			}
			if _, err := io.WriteString(c, answers[min(int(i), len(answers)-1)]); err != nil {
				return
			}
		}
	})
	c := leanClient(t, addr)
	for i := range 4 {
		var buf bytes.Buffer
		if err := c.Read(context.Background(), Request{Method: http.MethodGet, Path: "/"}, &buf); err != nil || buf.String() != "{}" {
			t.Fatalf("call %d: %q %v", i, buf.String(), err)
		}
	}
	if n := accepted.Load(); n != 3 {
		t.Fatalf("%d connections for 4 calls, want 3 (close asked, stray bytes, then one kept)", n)
	}
}

// A streamed body (an upload) goes through net/http's transport, which
// reads an answer the agent gives before the body is all sent.
func TestLeanStreamedBodyEarlyAnswer(t *testing.T) {
	s := newLeanServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusRequestEntityTooLarge)
		fmt.Fprint(w, "the archive is larger than the limit")
	})
	c := leanClient(t, s.URL)
	body := io.MultiReader(strings.NewReader(strings.Repeat("x", 8<<20)))
	_, _, err := c.Do(context.Background(), Request{Method: http.MethodPost, Path: "/upload", Body: body, ContentType: "application/octet-stream"})
	if err == nil || !strings.Contains(err.Error(), "larger than the limit") {
		t.Fatalf("an early refusal of an upload: %v", err)
	}
}

// Through connections that are not sockets (an SSH tunnel's): a body
// closed early with its rest received keeps its connection usable; a POST
// takes the kept one too (its reader saw nothing arrive while it was
// idle); one the agent closed is found so before a GET or a POST is sent
// on it, and each goes on a new connection, once.
func TestLeanThroughChannels(t *testing.T) {
	s := newLeanServer(t, func(w http.ResponseWriter, r *http.Request) {
		jsonOK(w, strings.Repeat(" ", 1000)+`{"id":"ok"}`)
	})
	c := channelClient(t, s.Listener.Addr().String())
	ctx := context.Background()
	resp, cancel, err := c.Do(ctx, Request{Method: http.MethodGet, Path: "/"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(resp.Body, make([]byte, 10)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	resp.Body.Close()
	cancel()
	get := func(what string) {
		t.Helper()
		var out struct{ ID string }
		if err := c.JSON(ctx, Request{Method: http.MethodGet, Path: "/"}, &out); err != nil || out.ID != "ok" {
			t.Fatalf("%s: %+v %v", what, out, err)
		}
	}
	get("a GET after an early close")
	if n := s.conns.Load(); n != 1 {
		t.Fatalf("%d connections after an early close and a GET, want 1", n)
	}
	if err := c.JSON(ctx, Request{Method: http.MethodPost, Path: "/", JSON: map[string]int{}}, nil); err != nil {
		t.Fatal(err)
	}
	if n := s.conns.Load(); n != 1 {
		t.Fatalf("%d connections after a POST, want 1 (the kept one)", n)
	}
	for _, m := range []string{http.MethodPost, http.MethodGet} {
		s.CloseClientConnections()
		time.Sleep(20 * time.Millisecond) // the close reaches the channel's reader
		if err := c.JSON(ctx, Request{Method: m, Path: "/", JSON: map[string]int{}}, nil); err != nil {
			t.Fatalf("a %s after the agent closed the kept connection: %v", m, err)
		}
	}
	if n := s.conns.Load(); n != 3 {
		t.Fatalf("%d connections after two closes, want 3", n)
	}
	if n := s.posts.Load(); n != 2 {
		t.Fatalf("the agent saw %d POSTs, want 2", n)
	}
}

// Bytes a channel receives while it sits idle (an agent that answered more
// than it said) make it unfit: the next call, a POST, goes on a new
// channel and reads its own answer, not those bytes.
func TestLeanChannelStrayBytes(t *testing.T) {
	var conns atomic.Int64
	addr := rawAgent(t, func(c net.Conn) {
		n := conns.Add(1)
		br := bufio.NewReader(c)
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			_, _ = io.Copy(io.Discard, req.Body)
			body := fmt.Sprintf(`{"id":"conn%d"}`, n)
			fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
			if n == 1 {
				time.Sleep(10 * time.Millisecond)
				fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\n{\"id\":\"stray\"}")
			}
		}
	})
	c := channelClient(t, addr)
	ctx := context.Background()
	var out struct{ ID string }
	if err := c.JSON(ctx, Request{Method: http.MethodGet, Path: "/"}, &out); err != nil || out.ID != "conn1" {
		t.Fatalf("first call: %+v %v", out, err)
	}
	time.Sleep(50 * time.Millisecond) // the stray answer arrives while idle
	if err := c.JSON(ctx, Request{Method: http.MethodPost, Path: "/", JSON: map[string]int{}}, &out); err != nil || out.ID != "conn2" {
		t.Fatalf("a POST after stray bytes: %+v %v (want its own answer, on a new connection)", out, err)
	}
	if n := conns.Load(); n != 2 {
		t.Fatalf("the agent saw %d connections, want 2", n)
	}
}

// An agent whose answer's head never ends is refused at the head's bound,
// without the client holding it.
func TestLeanAnswerHeadIsBounded(t *testing.T) {
	addr := rawAgent(t, func(c net.Conn) {
		if _, err := c.Read(make([]byte, 4096)); err != nil {
			return
		}
		line := "X-Junk: " + strings.Repeat("a", 1000) + "\r\n"
		if _, err := io.WriteString(c, "HTTP/1.1 200 OK\r\n"); err != nil {
			return
		}
		for range 256 << 10 { // 256 MiB of headers
			if _, err := io.WriteString(c, line); err != nil {
				return
			}
		}
	})
	c := leanClient(t, addr)
	var before, ms runtime.MemStats
	runtime.ReadMemStats(&before)
	err := c.JSON(context.Background(), Request{Method: http.MethodGet, Path: "/"}, nil)
	runtime.ReadMemStats(&ms)
	ms.TotalAlloc -= before.TotalAlloc
	if err == nil || !strings.Contains(err.Error(), "head is larger") {
		t.Fatalf("an endless head: %v", err)
	}
	if ms.TotalAlloc > 64<<20 {
		t.Fatalf("the client allocated %d MiB for a refused head", ms.TotalAlloc>>20)
	}
}

// Over a Unix socket (unix:///path): calls share one kept connection, and
// a POST after the agent closed it is sent once, on a new one.
func TestLeanUnixSocket(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "agent.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	s := newLeanServerOn(t, ln, func(w http.ResponseWriter, r *http.Request) { jsonOK(w, `{"id":"ok"}`) })
	c := leanClient(t, "unix://"+sock)
	ctx := context.Background()
	for range 5 {
		var out struct{ ID string }
		if err := c.JSON(ctx, Request{Method: http.MethodGet, Path: "/"}, &out); err != nil || out.ID != "ok" {
			t.Fatalf("%+v %v", out, err)
		}
	}
	if n := s.conns.Load(); n != 1 {
		t.Fatalf("5 calls over a Unix socket opened %d connections, want 1", n)
	}
	s.CloseClientConnections()
	time.Sleep(20 * time.Millisecond)
	if err := c.JSON(ctx, Request{Method: http.MethodPost, Path: "/", JSON: map[string]int{}}, nil); err != nil {
		t.Fatalf("a POST after the agent closed the kept connection: %v", err)
	}
	if n := s.posts.Load(); n != 1 {
		t.Fatalf("the agent saw %d POSTs, want 1", n)
	}
}

// A connection kept past idleFor (under the agents' own keep-alive limit)
// is not used again: the call opens a new one and the old one is closed.
func TestLeanIdleLimit(t *testing.T) {
	s := newLeanServer(t, func(w http.ResponseWriter, r *http.Request) { jsonOK(w, `{}`) })
	c := leanClient(t, s.URL)
	tr, ok := c.HTTP.Transport.(*lean)
	if !ok {
		t.Fatalf("the client's transport is a %T", c.HTTP.Transport)
	}
	var mu sync.Mutex
	now := time.Unix(1000, 0)
	tr.now = func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
	call := func() {
		t.Helper()
		if err := c.JSON(context.Background(), Request{Method: http.MethodGet, Path: "/"}, nil); err != nil {
			t.Fatal(err)
		}
	}
	call()
	advance(tr.idleFor - time.Second)
	call()
	if n := s.conns.Load(); n != 1 {
		t.Fatalf("%d connections within the idle limit, want 1", n)
	}
	advance(tr.idleFor + time.Second)
	call()
	if n := s.conns.Load(); n != 2 {
		t.Fatalf("%d connections after the idle limit, want 2", n)
	}
	if tr.idleFor >= 60*time.Second {
		t.Fatalf("idleFor %v is not under the shim's 60 s keep-alive", tr.idleFor)
	}
}
