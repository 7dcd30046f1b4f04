package gpu

import (
	"errors"
	"slices"
	"testing"
)

func TestLocks(t *testing.T) {
	l := NewLocks([]string{"g0", "g1", "g2", "g3"})
	got, err := l.Acquire("a", 2)
	if err != nil || !slices.Equal(got, []string{"g0", "g1"}) {
		t.Fatalf("acquire 2: %v %v", got, err)
	}
	if _, err := l.Acquire("b", 3); !errors.Is(err, ErrNoCapacity) || err.Error() != "no capacity: 3 GPUs requested, 2 available" {
		t.Fatalf("all or nothing: %v", err)
	}
	if l.Free() != 2 {
		t.Fatal("a failed acquire must lock nothing")
	}
	all, err := l.Acquire("b", -1)
	if err != nil || !slices.Equal(all, []string{"g2", "g3"}) {
		t.Fatalf("acquire all free: %v %v", all, err)
	}
	none, err := l.Acquire("c", -1)
	if err != nil || none == nil || len(none) != 0 {
		t.Fatalf("-1 with nothing free is an empty list, not an error: %v %v", none, err)
	}
	// A's GPUs go back; B's repeated or stale release of A's ids frees nothing.
	l.Release("a", []string{"g0", "g1"})
	again, _ := l.Acquire("d", 1)
	l.Release("a", []string{"g0", "g1"})
	if l.Free() != 1 || again[0] != "g0" {
		t.Fatalf("double release freed a GPU now held by d: free=%d", l.Free())
	}
	if err := l.Lock("e", []string{"g0"}); err == nil {
		t.Fatal("re-locking another task's GPU must fail")
	}
	for _, n := range []int{0, -2} {
		if _, err := l.Acquire("x", n); err == nil {
			t.Fatalf("acquire %d must fail", n)
		}
	}
}
