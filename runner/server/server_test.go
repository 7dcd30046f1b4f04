package server

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/runner/executor"
)

func newTestServer(t testing.TB) http.Handler {
	x, err := executor.New(executor.Config{TempDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	return New(Deps{Version: "test", Executor: x, Log: logging.Discard()})
}

func do(h http.Handler, method, path, ctype, body string) (int, string) {
	req := httptest.NewRequest(method, path, strings.NewReader(body))
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	b, _ := io.ReadAll(rec.Body)
	return rec.Code, string(b)
}

func part(name, filename string) string {
	disp := `form-data; name="` + name + `"`
	if filename != "" {
		disp += `; filename="` + filename + `"`
	}
	return "--B\r\nContent-Disposition: " + disp + "\r\n\r\ndata\r\n"
}

func TestUploadArchiveTexts(t *testing.T) {
	h := newTestServer(t)
	if code, body := do(h, "POST", "/api/upload_archive", "", ""); code != 409 {
		t.Fatalf("before submit: %d %q", code, body)
	}
	if code, body := do(h, "POST", "/api/submit", "application/json", `{"job_spec":{"commands":["true"]},"unknown":1}`); code != 200 || body != "\n" {
		t.Fatalf("submit: %d %q", code, body)
	}
	mp := "multipart/form-data; boundary=B"
	tests := []struct{ ctype, body, want string }{
		{"", "", "missing content-type header\n"},
		{"text/plain", "", "multipart/form-data expected, got text/plain\n"},
		{"multipart/form-data", "", "missing boundary\n"},
		{mp, "--B--\r\n", "empty form\n"},
		{mp, part("", "x") + "--B--\r\n", "missing field name\n"},
		{mp, part("file", "x") + "--B--\r\n", "unexpected field file\n"},
		{mp, part("archive", "") + "--B--\r\n", "missing file name\n"},
		{mp, part("archive", "../x") + "--B--\r\n", "bad input: invalid archive id \"../x\"\n"},
		{mp, part("archive", "a/b") + "--B--\r\n", "bad input: invalid archive id \"a/b\"\n"},
		{mp, part("archive", "id1") + part("archive", "id2") + "--B--\r\n", "extra form field(s)\n"},
	}
	for _, tc := range tests {
		code, body := do(h, "POST", "/api/upload_archive", tc.ctype, tc.body)
		if code != 400 || body != tc.want {
			t.Errorf("%q %q: %d %q want 400 %q", tc.ctype, tc.body, code, body, tc.want)
		}
	}
	if code, body := do(h, "POST", "/api/upload_archive", mp, part("archive", "id1")+"--B--\r\n"); code != 200 || body != "\n" {
		t.Fatalf("good upload: %d %q", code, body)
	}
	if code, body := do(h, "GET", "/api/pull?timestamp=abc", "", ""); code != 400 {
		t.Fatalf("bad timestamp: %d %q", code, body)
	}
	if code, _ := do(h, "POST", "/api/submit", "application/json", `{"job_spec":{"commands":"ls"}}`); code != 400 {
		t.Fatal("wrong type must be 400")
	}
}

func FuzzRunnerRequests(f *testing.F) {
	f.Add(0, "application/json", `{"job_spec":{"commands":["a"],"user":{"uid":1}},"log_quota_hour":null}`)
	f.Add(1, "multipart/form-data; boundary=B", part("archive", "x")+"--B--\r\n")
	f.Add(2, "", "diff --git")
	f.Add(3, "", "")
	paths := []string{"/api/submit", "/api/upload_archive", "/api/upload_code", "/api/pull?timestamp=1"}
	f.Fuzz(func(t *testing.T, which int, ctype, body string) {
		h := newTestServer(t)
		_, _ = do(h, "POST", "/api/submit", "application/json", `{}`)
		p := paths[((which%len(paths))+len(paths))%len(paths)]
		method := "POST"
		if strings.HasPrefix(p, "/api/pull") {
			method = "GET"
		}
		if code, msg := do(h, method, p, ctype, body); code >= 500 && !strings.Contains(msg, "mime:") {
			t.Fatalf("%s %q %q: %d %q", p, ctype, body, code, msg)
		}
	})
}
