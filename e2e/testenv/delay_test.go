package testenv

import (
	"bytes"
	"io"
	"net"
	"testing"
	"time"
)

// The relay carries bytes both ways intact, holds each direction for half
// the round trip, and passes a half-close on after the data before it.
func TestDelayRelay(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() { // echo until the client's end, then close
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = io.Copy(c, c)
	}()
	const rtt = 200 * time.Millisecond
	r := StartDelayRelay(t, ln.Addr().String(), rtt)
	c, err := net.Dial("tcp", r.Addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	want := bytes.Repeat([]byte("0123456789abcdef"), 64<<10) // 1 MiB
	began := time.Now()
	go func() {
		_, _ = c.Write(want)
		_ = c.(*net.TCPConn).CloseWrite()
	}()
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatal(err)
	}
	took := time.Since(began)
	if !bytes.Equal(got, want) {
		t.Fatalf("echoed %d bytes, not the %d sent", len(got), len(want))
	}
	// Connect (one round trip) and the bytes' own round trip.
	if took < 2*rtt {
		t.Fatalf("round trip through the relay took %v, under 2x its %v", took, rtt)
	}
	if took > 2*rtt+2*time.Second {
		t.Fatalf("round trip through the relay took %v, far over 2x its %v", took, rtt)
	}
}
