package sshd

import (
	"net"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	gossh "golang.org/x/crypto/ssh"
)

func opts(t *testing.T, line string) (keyOptions, error) {
	t.Helper()
	_, _, o, _, err := gossh.ParseAuthorizedKey([]byte(line + " ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGa6ZRd7ZG7JXqZbWbKJ3b7h5pI6kY0cUQYvV0c8m1pF u@h"))
	if err != nil {
		t.Fatal(err)
	}
	return parseKeyOptions(o)
}

func TestKeyOptions(t *testing.T) {
	addr := &net.TCPAddr{IP: net.ParseIP("10.1.2.3"), Port: 5555}
	now := time.Date(2026, 11, 23, 0, 0, 0, 0, time.UTC)
	o, err := opts(t, `from="10.9.9.9",command="/bin/echo RESTRICTED",no-port-forwarding,no-pty,expiry-time="20000101"`)
	if err != nil {
		t.Fatal(err)
	}
	if !o.hasCommand || o.command != "/bin/echo RESTRICTED" || !o.noPty || o.permitsOpen("localhost", 80) {
		t.Fatalf("%+v", o)
	}
	if ok, why := o.admits(now, addr); ok || !strings.Contains(why, "expired") {
		t.Fatalf("expired key admitted: %v %s", ok, why)
	}
	o.expiry = time.Time{}
	if ok, why := o.admits(now, addr); ok || !strings.Contains(why, "from=") {
		t.Fatalf("from= mismatch admitted: %v %s", ok, why)
	}
	for _, tc := range []struct {
		from string
		ok   bool
	}{
		{`from="10.1.2.3"`, true}, {`from="10.1.*"`, true}, {`from="10.0.0.0/8"`, true},
		{`from="10.0.0.0/8,!10.1.2.3"`, false}, {`from="192.168.0.0/16"`, false}, {`from="10.1.2.?"`, true},
		// Only * and ? are wildcards, as in OpenSSH: brackets and
		// backslashes are themselves.
		{`from="10.1.2.[1-5]"`, false}, {`from="10.1.2.\\3"`, false}, {`from="10.*.3"`, true}, {`from="*2.3,!*.9"`, true},
	} {
		o, err := opts(t, tc.from)
		if err != nil {
			t.Fatal(err)
		}
		if ok, _ := o.admits(now, addr); ok != tc.ok {
			t.Errorf("%s: %v", tc.from, ok)
		}
	}
	o, _ = opts(t, `restrict,pty`)
	if !o.noPortForwarding || o.noPty || !o.noAgent {
		t.Fatalf("restrict,pty: %+v", o)
	}
	o, _ = opts(t, `permitopen="localhost:8080",permitopen="*:9000"`)
	if !o.permitsOpen("localhost", 8080) || o.permitsOpen("localhost", 8081) || !o.permitsOpen("db", 9000) {
		t.Fatalf("permitopen: %+v", o)
	}
	o, _ = opts(t, `permitlisten="9000",permitlisten="0.0.0.0:9001"`)
	if !o.permitsListen("localhost", 9000) || o.permitsListen("localhost", 9001) || !o.permitsListen("0.0.0.0", 9001) {
		t.Fatalf("permitlisten: %+v", o)
	}
	for _, bad := range []string{`cert-authority`, `tunnel="0"`, `principals="a"`, `no-such-option`, `expiry-time="tomorrow"`, `permitopen="nohostport"`} {
		if _, err := opts(t, bad); err == nil {
			t.Errorf("%s accepted", bad)
		}
	}
}

func TestGateEvictsOldestUnauthenticated(t *testing.T) {
	g := newGate(time.Minute, 3, 2, 10)
	mk := func(ip string, port int) net.Conn {
		a, b := net.Pipe()
		t.Cleanup(func() { a.Close(); b.Close() })
		return addrConn{Conn: a, remote: &net.TCPAddr{IP: net.ParseIP(ip), Port: port}}
	}
	c1, ev := g.admit(mk("10.0.0.1", 1))
	_, ev2 := g.admit(mk("10.0.0.1", 2))
	if len(ev)+len(ev2) != 0 {
		t.Fatal("evicted early")
	}
	// A third from the same source evicts that source's oldest.
	_, ev = g.admit(mk("10.0.0.1", 3))
	if len(ev) != 1 || ev[0] != c1 {
		t.Fatalf("per-source eviction: %v", ev)
	}
	// Another source fills the global cap, then evicts the oldest overall.
	g.admit(mk("10.0.0.2", 1))
	if p, _ := g.counts(); p != 3 {
		t.Fatalf("pending %d", p)
	}
	legit := mk("10.0.0.9", 1)
	gl, ev := g.admit(legit)
	if len(ev) != 1 {
		t.Fatalf("global eviction: %v", ev)
	}
	if _, ok := g.authenticated(legit.RemoteAddr(), nil); !ok {
		t.Fatal("authentication refused")
	}
	if p, a := g.counts(); p != 2 || a != 1 || !gl.authed.Load() {
		t.Fatalf("after auth: pending %d authed %d", p, a)
	}
	gl.Close()
	if _, a := g.counts(); a != 0 {
		t.Fatal("close did not release")
	}
}

type addrConn struct {
	net.Conn
	remote net.Addr
}

func (c addrConn) RemoteAddr() net.Addr { return c.remote }

// ackCounter is a connection that counts QuickAck calls.
type ackCounter struct {
	addrConn
	acks atomic.Int32
}

func (c *ackCounter) QuickAck() { c.acks.Add(1) }

// TestGateAcksAtOnceUntilAuthenticated: every read of an unauthenticated
// connection asks for an immediate acknowledgement (a Nagle client's key
// exchange otherwise waits 40 ms twice on the delayed one); once the
// connection authenticated, reads are left alone.
func TestGateAcksAtOnceUntilAuthenticated(t *testing.T) {
	g := newGate(time.Minute, 3, 2, 10)
	a, b := net.Pipe()
	t.Cleanup(func() { a.Close(); b.Close() })
	c := &ackCounter{addrConn: addrConn{Conn: a, remote: &net.TCPAddr{IP: net.ParseIP("10.0.0.1"), Port: 1}}}
	gc, _ := g.admit(c)
	read := func() {
		t.Helper()
		go func() { _, _ = b.Write([]byte("x")) }()
		if _, err := gc.Read(make([]byte, 4)); err != nil {
			t.Fatal(err)
		}
	}
	read()
	read()
	if n := c.acks.Load(); n != 2 {
		t.Fatalf("%d immediate acknowledgements for 2 reads before authentication", n)
	}
	if _, ok := g.authenticated(c.RemoteAddr(), nil); !ok {
		t.Fatal("authentication refused")
	}
	read()
	if n := c.acks.Load(); n != 2 {
		t.Fatalf("a read after authentication asked for an immediate acknowledgement (%d in all)", n)
	}
}

// globMatch agrees with a regular expression made from the pattern (* is
// .*, ? is ., every other byte itself) on any pattern and address.
func TestGlobMatch(t *testing.T) {
	for _, tc := range []struct {
		p, s string
		ok   bool
	}{
		{"", "", true}, {"", "a", false}, {"*", "", true}, {"*", "anything", true}, {"?", "", false},
		{"a*b*c", "axxbyyc", true}, {"a*b*c", "axxbyy", false}, {"*.example.com", "host.example.com", true},
		{"10.0.0.[1-5]", "10.0.0.3", false}, {"10.0.0.[1-5]", "10.0.0.[1-5]", true}, {`a\*`, `a\bc`, true}, {"**a", "xa", true},
	} {
		if got := globMatch(tc.p, tc.s); got != tc.ok {
			t.Errorf("globMatch(%q, %q) = %v, want %v", tc.p, tc.s, got, tc.ok)
		}
		if got := globRef(tc.p, tc.s); got != tc.ok {
			t.Errorf("the reference says %v for (%q, %q)", got, tc.p, tc.s)
		}
	}
}

func ascii(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= utf8.RuneSelf {
			return false
		}
	}
	return true
}

func globRef(p, s string) bool {
	var re strings.Builder
	re.WriteString("^")
	for _, c := range []byte(p) {
		switch c {
		case '*':
			re.WriteString("(?s:.*)")
		case '?':
			re.WriteString("(?s:.)")
		default:
			re.WriteString(regexp.QuoteMeta(string([]byte{c})))
		}
	}
	re.WriteString("$")
	return regexp.MustCompile(re.String()).Match([]byte(s))
}

// FuzzKeyOptions: any authorized_keys options parse or are refused without
// a panic; what parses answers admits and the forward checks without one;
// and the pattern match agrees with the regular-expression reference.
func FuzzKeyOptions(f *testing.F) {
	for _, seed := range []string{`from="10.0.0.0/8,!10.1.2.3"`, `permitopen="localhost:8080",permitlisten="9000"`,
		`restrict,pty,command="echo \"hi\""`, `expiry-time="20260102"`, `environment="A=b"`, `from="*.[a-z]?"`} {
		f.Add(seed, "10.1.2.3", "localhost", uint16(8080))
	}
	now := time.Date(2026, 11, 23, 0, 0, 0, 0, time.UTC)
	f.Fuzz(func(t *testing.T, line, ip, host string, port uint16) {
		if _, _, o, _, err := gossh.ParseAuthorizedKey([]byte(line + " ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGa6ZRd7ZG7JXqZbWbKJ3b7h5pI6kY0cUQYvV0c8m1pF u@h")); err == nil {
			if k, err := parseKeyOptions(o); err == nil {
				_, _ = k.admits(now, &net.TCPAddr{IP: net.ParseIP(ip), Port: int(port)})
				_ = k.permitsOpen(host, uint32(port))
				_ = k.permitsListen(host, uint32(port))
			}
		}
		// The reference's . is a rune, not a byte: ASCII only.
		if len(line) <= 64 && len(ip) <= 64 && ascii(line) && ascii(ip) {
			if got, want := globMatch(line, ip), globRef(line, ip); got != want {
				t.Fatalf("globMatch(%q, %q) = %v, the reference %v", line, ip, got, want)
			}
		}
	})
}
