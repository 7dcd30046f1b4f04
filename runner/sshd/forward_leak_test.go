package sshd

import (
	"crypto/ed25519"
	"crypto/rand"
	"log/slog"
	"net"
	"testing"
	"time"

	gossh "golang.org/x/crypto/ssh"
)

// TestDynamicReverseForwardsAllClose (issue 39): two -R 0 forwards on one
// connection are two listeners, tracked by the port each got; both close
// when the connection ends (they shared one key and the first stayed open
// for the container's life).
func TestDynamicReverseForwardsAllClose(t *testing.T) {
	keys := &KeySet{}
	_, clientPriv, _ := ed25519.GenerateKey(rand.Reader)
	signer, _ := gossh.NewSignerFromKey(clientPriv)
	if err := keys.Add(string(gossh.MarshalAuthorizedKey(signer.PublicKey()))); err != nil {
		t.Fatal(err)
	}
	srv, err := New(Config{HostKeyDir: t.TempDir(), Log: slog.New(slog.DiscardHandler)}, keys)
	if err != nil {
		t.Fatal(err)
	}
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	c, err := gossh.Dial("tcp", ln.Addr().String(), &gossh.ClientConfig{User: "root", Auth: []gossh.AuthMethod{gossh.PublicKeys(signer)},
		HostKeyCallback: gossh.InsecureIgnoreHostKey()}) //nolint:gosec // test
	if err != nil {
		t.Fatal(err)
	}
	var ports []string
	for range 2 {
		rl, err := c.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("-R 0: %v", err)
		}
		ports = append(ports, rl.Addr().String())
	}
	if ports[0] == ports[1] {
		t.Fatalf("two forwards, one port: %v", ports)
	}
	for _, p := range ports {
		if cc, err := net.Dial("tcp", p); err != nil {
			t.Fatalf("forward %s does not listen: %v", p, err)
		} else {
			cc.Close()
		}
	}
	c.Close()
	deadline := time.Now().Add(5 * time.Second)
	for _, p := range ports {
		for {
			cc, err := net.Dial("tcp", p)
			if err != nil {
				break
			}
			cc.Close()
			if time.Now().After(deadline) {
				t.Fatalf("the listener %s outlived its connection", p)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}
