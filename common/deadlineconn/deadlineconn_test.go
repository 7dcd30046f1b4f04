package deadlineconn

import (
	"net"
	"testing"
	"time"
)

// A passed deadline ends a blocked Read; a deadline cleared before it
// passes leaves the connection working.
func TestDeadlineClosesAndClears(t *testing.T) {
	a, b := net.Pipe()
	defer b.Close()
	c := Wrap(a)
	if err := c.SetDeadline(time.Now().Add(30 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if err := c.SetDeadline(time.Time{}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(60 * time.Millisecond)
	go func() { _, _ = b.Write([]byte("x")) }()
	if _, err := c.Read(make([]byte, 1)); err != nil {
		t.Fatalf("a cleared deadline still closed the connection: %v", err)
	}
	if err := c.SetReadDeadline(time.Now().Add(30 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := c.Read(make([]byte, 1))
		done <- err
	}()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("a Read past its deadline returned data")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a passed deadline did not end a blocked Read")
	}
}
