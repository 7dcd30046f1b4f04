package fastpull

import (
	"container/heap"
	"context"
	"sync"
)

// gate bounds one pull's open requests and hands a free slot to the
// waiter with the lowest rank: the earliest layer's earliest range. Docker
// unpacks layers in order, each only once all its bytes are here, so the
// link's bytes go to the layer it unpacks next; with every range equal, a
// large middle layer arrived last and held Docker's unpacking back.
type gate struct {
	mu      sync.Mutex // guards free and waiting
	free    int
	waiting waiters
}

func newGate(n int) *gate { return &gate{free: n} }

// rank orders a request: layer i's range at off (off < maxBlob).
func rank(i int, off int64) int64 { return int64(i)*maxBlob + off }

// acquire takes a slot, waiting its turn by rank, or returns ctx's cause.
func (g *gate) acquire(ctx context.Context, r int64) error {
	g.mu.Lock()
	if g.free > 0 && len(g.waiting) == 0 {
		g.free--
		g.mu.Unlock()
		return nil
	}
	w := &waiter{rank: r, ready: make(chan struct{})}
	heap.Push(&g.waiting, w)
	g.mu.Unlock()
	select {
	case <-w.ready:
		return nil
	case <-ctx.Done():
		g.mu.Lock()
		defer g.mu.Unlock()
		if w.index < 0 { // handed a slot meanwhile: give it on
			g.releaseLocked()
		} else {
			heap.Remove(&g.waiting, w.index)
		}
		return context.Cause(ctx)
	}
}

// release gives a slot back, to the best-ranked waiter if any.
func (g *gate) release() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.releaseLocked()
}

func (g *gate) releaseLocked() {
	if len(g.waiting) == 0 {
		g.free++
		return
	}
	w := heap.Pop(&g.waiting).(*waiter)
	close(w.ready)
}

type waiter struct {
	rank  int64
	index int // in waiters; -1 once handed a slot
	ready chan struct{}
}

// waiters is a min-heap by rank.
type waiters []*waiter

func (h waiters) Len() int           { return len(h) }
func (h waiters) Less(i, j int) bool { return h[i].rank < h[j].rank }
func (h waiters) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index, h[j].index = i, j
}
func (h *waiters) Push(x any) {
	w := x.(*waiter)
	w.index = len(*h)
	*h = append(*h, w)
}
func (h *waiters) Pop() any {
	old := *h
	w := old[len(old)-1]
	old[len(old)-1] = nil
	w.index = -1
	*h = old[:len(old)-1]
	return w
}
