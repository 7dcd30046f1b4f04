package fastpull

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

// The gate hands freed slots to the earliest layer's earliest range, and a
// waiter that gives up leaves the queue (or passes on a slot it was given).
func TestGateOrder(t *testing.T) {
	g := newGate(1)
	if err := g.acquire(context.Background(), rank(9, 0)); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var order []int64
	var wg sync.WaitGroup
	ranks := []int64{rank(3, 5), rank(1, 7), rank(3, 0), rank(0, 1<<30), rank(2, 0)}
	for _, r := range ranks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := g.acquire(context.Background(), r); err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			order = append(order, r)
			mu.Unlock()
			g.release()
		}()
	}
	gone, cancel := context.WithCancelCause(context.Background())
	quit := make(chan error, 1)
	go func() { quit <- g.acquire(gone, rank(0, 0)) }()
	for {
		g.mu.Lock()
		n := len(g.waiting)
		g.mu.Unlock()
		if n == len(ranks)+1 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	why := errors.New("the pull is over")
	cancel(why)
	if err := <-quit; !errors.Is(err, why) {
		t.Fatalf("a cancelled waiter: %v", err)
	}
	g.release()
	wg.Wait()
	want := []int64{rank(0, 1<<30), rank(1, 7), rank(2, 0), rank(3, 0), rank(3, 5)}
	for i := range want {
		if order[i] != want[i] {
			t.Fatalf("order %v, want %v", order, want)
		}
	}
	if g.free != 1 || len(g.waiting) != 0 {
		t.Fatalf("free %d, %d waiting", g.free, len(g.waiting))
	}
}
