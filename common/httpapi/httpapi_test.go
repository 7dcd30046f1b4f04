package httpapi

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"

	"github.com/tandem-run/tandem/common/logging"

	"github.com/labstack/echo/v4"
)

type payload struct {
	ID    string `json:"id"`
	Count int    `json:"count"`
}

func newServer(t *testing.T) *httptest.Server {
	t.Helper()
	e := NewEcho(logging.Discard())
	e.POST("/api/thing", func(c echo.Context) error {
		var p payload
		if err := Bind(c, &p); err != nil {
			return err
		}
		if p.ID == "" {
			return Errorf(http.StatusBadRequest, "empty id")
		}
		return JSON(c, p)
	})
	e.POST("/api/empty", OK)
	e.GET("/api/panic", func(echo.Context) error { panic("boom") })
	e.GET("/api/internal", func(echo.Context) error { return errors.New("secret detail") })
	srv := httptest.NewServer(e)
	t.Cleanup(srv.Close)
	return srv
}

func TestServerConventions(t *testing.T) {
	srv := newServer(t)
	big := `{"id":"` + strings.Repeat("x", MaxBodyBytes) + `"}`
	tests := []struct {
		name, method, path, ctype, body string
		wantStatus                      int
		wantBody                        string
		wantCT                          string
	}{
		{"ok json", "POST", "/api/thing", "application/json", `{"id":"a","count":2,"unknown":[1]}`, 200, `{"id":"a","count":2}` + "\n", "application/json"},
		{"ct with params", "POST", "/api/thing", "application/json; charset=utf-8", `{"id":"a"}`, 200, `{"id":"a","count":0}` + "\n", "application/json"},
		{"no content type", "POST", "/api/thing", "", `{"id":"a"}`, 200, `{"id":"a","count":0}` + "\n", "application/json"},
		{"wrong content type", "POST", "/api/thing", "text/plain", `{"id":"a"}`, 415, "Content-Type header is not application/json\n", "text/plain; charset=utf-8"},
		{"empty body", "POST", "/api/thing", "application/json", ``, 400, "Request body must not be empty\n", "text/plain; charset=utf-8"},
		{"malformed", "POST", "/api/thing", "application/json", `{"id":`, 400, "Request body contains badly-formed JSON\n", "text/plain; charset=utf-8"},
		{"syntax", "POST", "/api/thing", "application/json", `{"id" "a"}`, 400, "Request body contains badly-formed JSON (at position 7)\n", "text/plain; charset=utf-8"},
		{"wrong type", "POST", "/api/thing", "application/json", `{"id":"a","count":"x"}`, 400, "Request body contains an invalid value for the \"count\" field (at position 21)\n", "text/plain; charset=utf-8"},
		{"two values", "POST", "/api/thing", "application/json", `{"id":"a"}{"id":"b"}`, 400, "Request body must only contain a single JSON object\n", "text/plain; charset=utf-8"},
		{"too large", "POST", "/api/thing", "application/json", big, 413, "Request body must not be larger than 1MB\n", "text/plain; charset=utf-8"},
		{"handler 400", "POST", "/api/thing", "application/json", `{}`, 400, "empty id\n", "text/plain; charset=utf-8"},
		{"empty 200", "POST", "/api/empty", "", ``, 200, "\n", "text/plain; charset=utf-8"},
		{"unknown route", "GET", "/api/nope", "", ``, 404, "404 page not found\n", "text/plain; charset=utf-8"},
		{"wrong method", "GET", "/api/thing", "", ``, 405, "Method Not Allowed\n", "text/plain; charset=utf-8"},
		{"panic is 500", "GET", "/api/panic", "", ``, 500, "\n", "text/plain; charset=utf-8"},
		{"internal error hidden", "GET", "/api/internal", "", ``, 500, "\n", "text/plain; charset=utf-8"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req, err := http.NewRequest(tc.method, srv.URL+tc.path, strings.NewReader(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			if tc.ctype != "" {
				req.Header.Set("Content-Type", tc.ctype)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != tc.wantStatus || string(b) != tc.wantBody {
				t.Fatalf("got %d %q, want %d %q", resp.StatusCode, b, tc.wantStatus, tc.wantBody)
			}
			if ct := resp.Header.Get("Content-Type"); ct != tc.wantCT {
				t.Fatalf("content type %q, want %q", ct, tc.wantCT)
			}
			if tc.wantCT != "application/json" && resp.Header.Get("X-Content-Type-Options") != "nosniff" {
				t.Fatal("text responses carry nosniff")
			}
			if tc.wantStatus == 405 && resp.Header.Get("Allow") == "" {
				t.Fatal("405 must carry Allow")
			}
		})
	}
}

// A request whose caller left (dstack's server gives up after 9 s) ends
// in its context's error: that is logged as the caller leaving, at info,
// not as the agent's internal error, and nothing is written. The same
// error while the caller still waits is a 500.
func TestCallerLeftIsNotAnInternalError(t *testing.T) {
	var logged bytes.Buffer
	e := NewEcho(slog.New(slog.NewTextHandler(&logged, &slog.HandlerOptions{Level: slog.LevelDebug})))
	e.POST("/api/stop", func(c echo.Context) error {
		<-c.Request().Context().Done()
		return Internal("failed to stop", fmt.Errorf("stop: %w", c.Request().Context().Err()))
	})
	e.POST("/api/cancelled", func(echo.Context) error { return Internal("x", context.Canceled) })

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	rec := httptest.NewRecorder()
	e.ServeHTTP(rec, httptest.NewRequest("POST", "/api/stop", nil).WithContext(ctx))
	if rec.Body.Len() != 0 || strings.Contains(logged.String(), "level=ERROR") || !strings.Contains(logged.String(), `level=INFO msg="the caller left before the answer"`) {
		t.Fatalf("caller gone: wrote %d %q, logged %s", rec.Code, rec.Body, logged.String())
	}
	if got := StatusFor(e.NewContext(httptest.NewRequest("GET", "/", nil).WithContext(ctx), rec), context.Canceled); got != StatusCallerLeft {
		t.Fatalf("StatusFor a caller that left: %d", got)
	}

	logged.Reset()
	rec = httptest.NewRecorder()
	e.ServeHTTP(rec, httptest.NewRequest("POST", "/api/cancelled", nil))
	if rec.Code != http.StatusInternalServerError || !strings.Contains(logged.String(), "level=ERROR") {
		t.Fatalf("a cancelled call inside, caller waiting: %d, logged %s", rec.Code, logged.String())
	}
}

// errReader fails every read with err.
type errReader struct{ err error }

func (r errReader) Read([]byte) (int, error) { return 0, r.err }

// A body the connection lost (the gate evicted it, its deadline passed)
// is a 400 that keeps its cause, so the error handler logs a closed
// connection quietly, and says nothing of this host's addresses.
func TestBodyLostWithTheConnection(t *testing.T) {
	for _, cause := range []error{
		&net.OpError{Op: "read", Net: "tcp", Source: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 33023}, Err: net.ErrClosed},
		fmt.Errorf("read: %w", os.ErrDeadlineExceeded),
	} {
		req := httptest.NewRequest("POST", "/", io.MultiReader(strings.NewReader(`{"id":`), errReader{cause}))
		err := DecodeJSON(req, httptest.NewRecorder(), &payload{})
		var apiErr *Error
		if !errors.As(err, &apiErr) || apiErr.Status != http.StatusBadRequest || !errors.Is(err, cause) ||
			apiErr.Message != "Request body could not be read" {
			t.Fatalf("%v: got %#v", cause, err)
		}
	}
	var logged bytes.Buffer
	e := NewEcho(slog.New(slog.NewTextHandler(&logged, &slog.HandlerOptions{Level: slog.LevelInfo})))
	e.POST("/api/thing", func(c echo.Context) error { return Bind(c, &payload{}) })
	req := httptest.NewRequest("POST", "/api/thing", errReader{&net.OpError{Op: "read", Net: "tcp", Err: net.ErrClosed}})
	e.ServeHTTP(httptest.NewRecorder(), req)
	if logged.Len() != 0 {
		t.Fatalf("an evicted body logged above debug: %s", logged.String())
	}
}

func FuzzDecodeJSON(f *testing.F) {
	f.Add("application/json", []byte(`{"id":"a","count":1}`))
	f.Add("", []byte(`{"id":`))
	f.Add("text/html", []byte(`{}`))
	f.Add("application/json; charset=\"", []byte(`[]`))
	f.Fuzz(func(t *testing.T, ctype string, body []byte) {
		req := httptest.NewRequest("POST", "/", strings.NewReader(string(body)))
		if ctype != "" {
			req.Header.Set("Content-Type", ctype)
		}
		var p payload
		err := DecodeJSON(req, httptest.NewRecorder(), &p)
		if err != nil && !IsClientError(err) {
			t.Fatalf("decode failure must be a 4xx API error, got %v", err)
		}
	})
}

// IsClientError reports whether err is an API error with a 4xx status.
func IsClientError(err error) bool {
	var apiErr *Error
	return errors.As(err, &apiErr) && apiErr.Status >= 400 && apiErr.Status < 500
}

// An error's text says its message once, also when the cause wraps the
// message's own class error (the shim's 507 logged it twice).
func TestErrorSaysItsMessageOnce(t *testing.T) {
	class := errors.New("the shim cannot save the task's record")
	for _, c := range []struct {
		e    *Error
		want string
	}{
		{&Error{Status: 507, Message: class.Error(), Err: fmt.Errorf("%w: disk full", class)}, "507 the shim cannot save the task's record: disk full"},
		{&Error{Status: 500, Message: "failed to stop", Err: errors.New("timeout")}, "500 failed to stop: timeout"},
		{&Error{Status: 409, Message: "conflict"}, "409 conflict"},
	} {
		if got := c.e.Error(); got != c.want {
			t.Errorf("%q, want %q", got, c.want)
		}
	}
}
