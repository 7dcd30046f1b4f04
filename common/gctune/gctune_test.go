package gctune

import (
	"runtime"
	"runtime/debug"
	"testing"
	"time"
)

var keep [][]byte

func waitLimit(t *testing.T, tu *Tuner, ok func(int64) bool) int64 {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		runtime.GC()
		time.Sleep(10 * time.Millisecond) // the finalizer goroutine runs
		if l := tu.Limit(); ok(l) {
			return l
		}
		if time.Now().After(deadline) {
			t.Fatalf("limit %d never reached the expected range", tu.Limit())
		}
	}
}

func TestLimitFollowsTheLiveHeap(t *testing.T) {
	defer debug.SetMemoryLimit(debug.SetMemoryLimit(-1))
	const floor = 8 << 20
	tu := Start(floor)
	defer tu.Stop()
	if got := debug.SetMemoryLimit(-1); got != floor {
		t.Fatalf("limit at start %d, want the floor", got)
	}
	// 64 MiB live: the limit rises above it, leaving room to grow as
	// GOGC=100 would.
	for range 64 {
		keep = append(keep, make([]byte, 1<<20))
	}
	high := waitLimit(t, tu, func(l int64) bool { return l >= 128<<20 })
	if got := debug.SetMemoryLimit(-1); got != high {
		t.Fatalf("runtime limit %d, tuner says %d", got, high)
	}
	// Dropped again: back to the floor (the test binary's own heap is
	// small).
	keep = nil
	waitLimit(t, tu, func(l int64) bool { return l < 64<<20 })

	tu.Stop()
	last := tu.Limit()
	for range 64 {
		keep = append(keep, make([]byte, 1<<20))
	}
	runtime.GC()
	time.Sleep(50 * time.Millisecond)
	if tu.Limit() != last {
		t.Fatal("a stopped tuner moved the limit")
	}
	keep = nil
}
