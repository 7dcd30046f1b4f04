package sshd

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	gossh "golang.org/x/crypto/ssh"
)

func TestHostKeysPersist(t *testing.T) {
	dir := t.TempDir()
	first, made, err := hostKeys(dir)
	if err != nil || len(first) != 2 {
		t.Fatalf("%v %d", err, len(first))
	}
	if first[0].PublicKey().Type() != "ssh-ed25519" || first[1].PublicKey().Type() != "ecdsa-sha2-nistp256" {
		t.Fatalf("key types %s %s", first[0].PublicKey().Type(), first[1].PublicKey().Type())
	}
	// Nothing is on disk before the save: a start that dies here makes new keys.
	if left, _ := filepath.Glob(filepath.Join(dir, "*")); len(left) != 0 {
		t.Fatalf("written before save: %v", left)
	}
	if err := saveKeyFiles(made); err != nil {
		t.Fatal(err)
	}
	again, madeAgain, err := hostKeys(dir)
	if err != nil {
		t.Fatal(err)
	}
	for i := range first {
		if !bytes.Equal(first[i].PublicKey().Marshal(), again[i].PublicKey().Marshal()) {
			t.Fatal("a restart must keep the host identity")
		}
	}
	// Keys read from disk are not written again.
	before, _ := os.Stat(filepath.Join(dir, "ssh_host_ed25519_key"))
	if err := saveKeyFiles(madeAgain); err != nil {
		t.Fatal(err)
	}
	if after, _ := os.Stat(filepath.Join(dir, "ssh_host_ed25519_key")); !os.SameFile(before, after) {
		t.Fatal("a loaded key was written again")
	}
}

// The server is made, and can serve, before its keys are saved; SaveKeys
// writes the keys and then the public keys file, whose lines are the keys
// it serves with.
func TestSaveKeysAfterNew(t *testing.T) {
	dir := t.TempDir()
	pub := filepath.Join(dir, "host_keys.pub")
	s, err := New(Config{HostKeyDir: filepath.Join(dir, "keys"), PublicKeysFile: pub, Log: slog.New(slog.DiscardHandler)}, &KeySet{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(pub); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("public keys file before SaveKeys: %v", err)
	}
	if err := s.SaveKeys(); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(pub)
	if err != nil {
		t.Fatal(err)
	}
	for _, sg := range s.signers {
		if !strings.Contains(string(b), strings.TrimSpace(string(gossh.MarshalAuthorizedKey(sg.PublicKey())))) {
			t.Fatalf("%s lacks %s", b, sg.PublicKey().Type())
		}
	}
	again, _, err := hostKeys(filepath.Join(dir, "keys"))
	if err != nil || !bytes.Equal(again[0].PublicKey().Marshal(), s.signers[0].PublicKey().Marshal()) {
		t.Fatalf("saved keys differ from the served ones: %v", err)
	}
}

func TestKeySet(t *testing.T) {
	var k KeySet
	if err := k.Add("not a key"); err == nil {
		t.Fatal("garbage keys are errors")
	}
	if err := k.Add("", "  "); err != nil {
		t.Fatal(err)
	}
}

// A real server over loopback: the channel cap rejects the channel beyond
// it and the connection keeps working.
func TestChannelCap(t *testing.T) {
	keys := &KeySet{}
	_, clientPriv, _ := ed25519.GenerateKey(rand.Reader)
	signer, _ := gossh.NewSignerFromKey(clientPriv)
	if err := keys.Add(string(gossh.MarshalAuthorizedKey(signer.PublicKey()))); err != nil {
		t.Fatal(err)
	}
	srv, err := New(Config{HostKeyDir: t.TempDir(), MaxChannels: 2, Log: slog.New(slog.DiscardHandler)}, keys)
	if err != nil {
		t.Fatal(err)
	}
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	echo, _ := net.Listen("tcp", "127.0.0.1:0")
	defer echo.Close()
	go func() {
		for {
			c, err := echo.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c) }()
		}
	}()
	c, err := gossh.Dial("tcp", ln.Addr().String(), &gossh.ClientConfig{User: "root", Auth: []gossh.AuthMethod{gossh.PublicKeys(signer)},
		HostKeyCallback: gossh.InsecureIgnoreHostKey()}) //nolint:gosec // test
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	a, err1 := c.Dial("tcp", echo.Addr().String())
	b, err2 := c.Dial("tcp", echo.Addr().String())
	if err1 != nil || err2 != nil {
		t.Fatalf("within the cap: %v %v", err1, err2)
	}
	if _, err := c.Dial("tcp", echo.Addr().String()); err == nil || !strings.Contains(err.Error(), "too many channels") {
		t.Fatalf("over the cap: %v", err)
	}
	a.Close()
	time.Sleep(100 * time.Millisecond)
	d, err := c.Dial("tcp", echo.Addr().String())
	if err != nil {
		t.Fatalf("a freed slot is usable again: %v", err)
	}
	_, _ = d.Write([]byte("ping"))
	buf := make([]byte, 4)
	if _, err := io.ReadFull(d, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("forward works: %q %v", buf, err)
	}
	b.Close()
	d.Close()
}

// A connection that never authenticates is dropped at LoginGrace, whether
// it stays silent or stalls after the version exchange: the per-read
// deadline updates of the SSH library must not lift the login deadline.
func TestLoginGraceDropsStalledConnections(t *testing.T) {
	srv, err := New(Config{HostKeyDir: t.TempDir(), LoginGrace: 300 * time.Millisecond, Log: slog.New(slog.DiscardHandler)}, &KeySet{})
	if err != nil {
		t.Fatal(err)
	}
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	for _, hello := range []string{"", "SSH-2.0-stall\r\n"} {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		_, _ = c.Write([]byte(hello))
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		start := time.Now()
		_, err = io.Copy(io.Discard, c) // the banner, maybe KEXINIT, then the close
		took := time.Since(start)
		c.Close()
		if err != nil || took > 3*time.Second {
			t.Fatalf("hello %q: connection held %s (err %v), want a drop at the 300ms grace", hello, took.Round(time.Millisecond), err)
		}
	}
}
