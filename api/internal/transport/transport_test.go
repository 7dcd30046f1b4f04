package transport

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
)

// A hostile answer with a field far past MaxAnswer is refused without the
// client holding it; an answer under the cap decodes (the control).
func TestJSONAnswerIsCapped(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		if r.URL.Path == "/small" {
			fmt.Fprint(w, `{"id":"ok"}`)
			return
		}
		fmt.Fprint(w, `{"id":"`)
		chunk := strings.Repeat("A", 1<<20)
		for range 512 { // 512 MiB
			if _, err := fmt.Fprint(w, chunk); err != nil {
				return
			}
		}
		fmt.Fprint(w, `"}`)
	}))
	defer srv.Close()
	c := &Client{BaseURL: srv.URL, HTTP: srv.Client()}
	var out struct{ ID string }
	if err := c.JSON(context.Background(), Request{Method: http.MethodGet, Path: "/small"}, &out); err != nil || out.ID != "ok" {
		t.Fatalf("control: %+v %v", out, err)
	}
	var before, ms runtime.MemStats
	runtime.ReadMemStats(&before)
	err := c.JSON(context.Background(), Request{Method: http.MethodGet, Path: "/huge"}, &out)
	runtime.ReadMemStats(&ms)
	ms.TotalAlloc -= before.TotalAlloc
	if err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Fatalf("huge answer: %v", err)
	}
	if ms.TotalAlloc > 200<<20 {
		t.Fatalf("the client allocated %d MiB for a refused answer", ms.TotalAlloc>>20)
	}
}

// Read keeps the same bound: a huge answer is refused and the buffer never
// holds more than MaxAnswer (a Content-Length past it is not trusted for
// sizing); a non-JSON answer is refused before its body is read.
func TestReadAnswerIsCapped(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/small":
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprint(w, `{"id":"ok"}`)
		case "/html":
			w.Header().Set("Content-Type", "text/html")
			fmt.Fprint(w, `<html></html>`)
		default:
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Content-Length", fmt.Sprint(1<<40))
			chunk := strings.Repeat("A", 1<<20)
			for range 64 {
				if _, err := fmt.Fprint(w, chunk); err != nil {
					return
				}
			}
		}
	}))
	defer srv.Close()
	c := &Client{BaseURL: srv.URL, HTTP: srv.Client()}
	var buf bytes.Buffer
	if err := c.Read(context.Background(), Request{Method: http.MethodGet, Path: "/small"}, &buf); err != nil || buf.String() != `{"id":"ok"}` {
		t.Fatalf("control: %q %v", buf.String(), err)
	}
	buf.Reset()
	if err := c.Read(context.Background(), Request{Method: http.MethodGet, Path: "/html"}, &buf); err == nil || !strings.Contains(err.Error(), "expected a JSON answer") || buf.Len() != 0 {
		t.Fatalf("html answer: %q %v", buf.String(), err)
	}
	err := c.Read(context.Background(), Request{Method: http.MethodGet, Path: "/huge"}, &buf)
	if err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Fatalf("huge answer: %v", err)
	}
	if buf.Len() > MaxAnswer || buf.Cap() > 2*MaxAnswer {
		t.Fatalf("the buffer holds %d bytes (capacity %d) for a refused answer", buf.Len(), buf.Cap())
	}
}
