package sshd

import (
	"bytes"
	"crypto/rand"
	"io"
	"net"
	"testing"
)

// pipe carries both directions byte for byte, passes each side's end on as
// a half-close (the far end answers after its peer shut its write side,
// and the client still gets all of it), and closes both at the end.
func TestCopierPipe(t *testing.T) {
	c := newCopier(1) // one side copies with a big buffer, the other small
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	up := make([]byte, 3<<20+17)
	down := make([]byte, 1<<20+5)
	_, _ = rand.Read(up)
	_, _ = rand.Read(down)
	gotUp := make(chan []byte, 1)
	go func() { // the far end: echo what it gets back as "down", keep "up"
		conn, err := ln.Accept()
		if err != nil {
			return
		}
		b, _ := io.ReadAll(conn) // the client's half-close ends this
		gotUp <- b
		_, _ = conn.Write(down)
		conn.Close()
	}()
	far, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	front, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer front.Close()
	done := make(chan struct{})
	go func() {
		near, err := front.Accept()
		if err == nil {
			c.pipe(near, far, nil)
		}
		close(done)
	}()
	client, err := net.Dial("tcp", front.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	go func() { _, _ = client.Write(up); client.(*net.TCPConn).CloseWrite() }()
	gotDown, _ := io.ReadAll(client)
	<-done
	if b := <-gotUp; !bytes.Equal(b, up) {
		t.Fatalf("up: %d bytes, want %d", len(b), len(up))
	}
	if !bytes.Equal(gotDown, down) {
		t.Fatalf("down: %d bytes, want %d", len(gotDown), len(down))
	}
}
