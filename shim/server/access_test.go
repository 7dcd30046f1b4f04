package server

import (
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/labstack/echo/v4"

	"github.com/tandem-run/tandem/common/httpapi"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/shim/origin"
	"github.com/tandem-run/tandem/shim/principal"
)

// accessServer serves a trivial API behind Access on a real loopback
// listener, as the shim does.
func accessServer(t *testing.T, a Access) string {
	t.Helper()
	e := httpapi.NewEcho(logging.Discard())
	a.Log = logging.Discard()
	e.Pre(a.Middleware())
	e.GET("/api/tasks", func(c echo.Context) error { return httpapi.OK(c) })
	e.POST("/api/tasks", func(c echo.Context) error { return httpapi.OK(c) })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := httpapi.NewServer(e, httpapi.DefaultLimits)
	gate := httpapi.NewGate(ln, httpapi.DefaultLimits, a.Admit(), a.Log)
	gate.Attach(hs)
	go func() { _ = hs.Serve(gate) }()
	t.Cleanup(func() { _ = hs.Close() })
	return ln.Addr().String()
}

func call(t *testing.T, method, url, host, ctype, token, body string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(method, url, strings.NewReader(body))
	if body == "" {
		req.Body = http.NoBody
		req.ContentLength = 0
	}
	if host != "" {
		req.Host = host
	}
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, strings.TrimSpace(string(b))
}

func TestAccessRules(t *testing.T) {
	addr := accessServer(t, Access{Check: origin.Checker{}.CheckBatch, Token: "s3cret", AllowedHosts: []string{"shim.internal"}})
	u := "http://" + addr + "/api/tasks"
	tests := []struct {
		name, method, host, ctype, token, body string
		want                                   int
	}{
		{"host caller with token", "GET", "", "", "s3cret", "", 200},
		{"localhost name", "GET", "localhost:1234", "", "s3cret", "", 200},
		{"configured name", "GET", "shim.internal", "", "s3cret", "", 200},
		{"the dstack server over its Unix-socket tunnel", "GET", "%2Ftmp%2Fdstack-ssh%2Fshim-10998.sock", "", "s3cret", "", 200},
		{"rebinding name", "GET", "evil.example.com:10998", "", "s3cret", "", http.StatusMisdirectedRequest},
		{"no token", "GET", "", "", "", "", http.StatusUnauthorized},
		{"wrong token", "GET", "", "", "guess", "", http.StatusUnauthorized},
		{"JSON body", "POST", "", "application/json", "s3cret", "{}", 200},
		{"body without type", "POST", "", "", "s3cret", "{}", http.StatusUnsupportedMediaType},
		{"form body", "POST", "", "application/x-www-form-urlencoded", "s3cret", "a=b", http.StatusUnsupportedMediaType},
		{"empty POST", "POST", "", "", "s3cret", "", 200},
	}
	for _, tc := range tests {
		if code, msg := call(t, tc.method, u, tc.host, tc.ctype, tc.token, tc.body); code != tc.want {
			t.Errorf("%s: %d %q, want %d", tc.name, code, msg, tc.want)
		}
	}
}

// TestAccessRefusesOtherMountNamespace: the same loopback, a client in its
// own mount namespace (a container's situation) gets 403 naming it; the
// kill switch lets it in.
func TestAccessRefusesOtherMountNamespace(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("unshare needs root")
	}
	bb, err := exec.LookPath("busybox")
	if err != nil {
		t.Skip("busybox missing")
	}
	for _, allow := range []bool{false, true} {
		addr := accessServer(t, Access{Check: origin.Checker{}.CheckBatch, AllowContainers: allow})
		out, _ := exec.Command("unshare", "--mount", bb, "wget", "-q", "-O", "-", "http://"+addr+"/api/tasks").CombinedOutput()
		refused := strings.Contains(string(out), "403")
		if refused == allow {
			t.Fatalf("allow=%v: %q", allow, out)
		}
	}
	// The host itself is served.
	addr := accessServer(t, Access{Check: origin.Checker{}.CheckBatch})
	if code, msg := call(t, "GET", "http://"+addr+"/api/tasks", "", "", "", ""); code != 200 {
		t.Fatalf("host caller: %d %q", code, msg)
	}
}

// fixedPolicy admits the uids listed.
type fixedPolicy map[uint32]bool

func (p fixedPolicy) Decide(uid uint32) principal.Decision {
	return principal.Decision{Allowed: p[uid], Who: "uid " + strconv.Itoa(int(uid)), Why: "not in the test's list"}
}

// TestAccessRefusesOrdinaryAccounts: a host process of an account that is
// not root-equivalent gets 403 naming its uid; the same process is served
// once its uid is admitted, and root always is.
func TestAccessRefusesOrdinaryAccounts(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to run a client as nobody")
	}
	bb, err := exec.LookPath("busybox")
	if err != nil {
		t.Skip("busybox missing")
	}
	asNobody := func(addr string) string {
		cmd := exec.Command(bb, "wget", "-q", "-O", "-", "http://"+addr+"/api/tasks")
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
		out, _ := cmd.CombinedOutput()
		return string(out)
	}
	addr := accessServer(t, Access{Check: origin.Checker{}.CheckBatch, Principals: fixedPolicy{0: true}})
	if out := asNobody(addr); !strings.Contains(out, "403") {
		t.Fatalf("nobody was served: %q", out)
	}
	if code, msg := call(t, "GET", "http://"+addr+"/api/tasks", "", "", "", ""); code != 200 {
		t.Fatalf("root refused: %d %q", code, msg)
	}
	addr = accessServer(t, Access{Check: origin.Checker{}.CheckBatch, Principals: fixedPolicy{0: true, 65534: true}})
	if out := asNobody(addr); strings.Contains(out, "403") {
		t.Fatalf("an admitted uid was refused: %q", out)
	}
}

// TestAccessRefusalText: the 403 names the uid and says what is admitted.
func TestAccessRefusalText(t *testing.T) {
	a := Access{Principals: fixedPolicy{}}
	ok, msg := a.decide(origin.Verdict{FromHost: true, UIDs: []uint32{1000}, Peer: "127.0.0.1:5 pid 9 (curl) uid 1000"}, theAPI)
	if ok || !strings.Contains(msg, "uid 1000") || !strings.Contains(msg, "root-equivalent") || !strings.Contains(msg, "pid 9") {
		t.Fatalf("%v %q", ok, msg)
	}
	// A container is refused for what it is, whatever its uid.
	ok, msg = Access{Principals: fixedPolicy{0: true}}.decide(origin.Verdict{UIDs: []uint32{0}, Peer: "p", Reason: "the client runs in another mount namespace (a container)"}, theAPI)
	if ok || !strings.Contains(msg, "serves only the host itself") {
		t.Fatalf("%v %q", ok, msg)
	}
}
