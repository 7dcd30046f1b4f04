package sshd

import (
	"testing"
	"time"
)

func TestTracker(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	tr := NewTracker()
	if tr.NoConnectionsSecs(at(50)) != 0 {
		t.Fatal("0 before tracking starts")
	}
	tr.Start(at(0))
	if got := tr.NoConnectionsSecs(at(30)); got != 30 {
		t.Fatalf("idle since start: %d", got)
	}
	short := tr.Opened(at(31))
	tr.Closed(short, at(35)) // a 4 s API tunnel is not activity
	if got := tr.NoConnectionsSecs(at(40)); got != 40 {
		t.Fatalf("short connections do not count: %d", got)
	}
	long := tr.Opened(at(41))
	if got := tr.NoConnectionsSecs(at(45)); got != 45 {
		t.Fatalf("a young connection does not count yet: %d", got)
	}
	if got := tr.NoConnectionsSecs(at(60)); got != 0 {
		t.Fatalf("an open long connection is activity: %d", got)
	}
	tr.Closed(long, at(100))
	if got := tr.NoConnectionsSecs(at(130)); got != 30 {
		t.Fatalf("idle since the long connection closed: %d", got)
	}
}
