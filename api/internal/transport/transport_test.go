package transport

import (
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
	var ms runtime.MemStats
	err := c.JSON(context.Background(), Request{Method: http.MethodGet, Path: "/huge"}, &out)
	runtime.ReadMemStats(&ms)
	if err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Fatalf("huge answer: %v", err)
	}
	if ms.TotalAlloc > 200<<20 {
		t.Fatalf("the client allocated %d MiB for a refused answer", ms.TotalAlloc>>20)
	}
}
