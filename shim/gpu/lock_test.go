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

// A GPU taken out of allocation goes to no new task, stays with the task
// that holds it, and comes back when its exclusion is lifted; the others
// stay allocatable.
func TestLocksExcludeAGPU(t *testing.T) {
	l := NewLocks([]string{"g0", "g1", "g2", "g3"})
	held, _ := l.Acquire("a", 1) // g0
	added, restored := l.Exclude(map[string]string{"g0": "XID 79", "g2": "double-bit ECC", "nope": "unknown id"})
	if !slices.Equal(added, []string{"g0", "g2"}) || restored != nil {
		t.Fatalf("changes: added %v restored %v", added, restored)
	}
	if again, _ := l.Exclude(map[string]string{"g0": "XID 79", "g2": "double-bit ECC"}); again != nil {
		t.Fatalf("the same set again is no change: %v", again)
	}
	if l.Free() != 2 || l.Total() != 4 {
		t.Fatalf("free %d total %d", l.Free(), l.Total())
	}
	got, err := l.Acquire("b", 2)
	if err != nil || !slices.Equal(got, []string{"g1", "g3"}) {
		t.Fatalf("healthy GPUs: %v %v", got, err)
	}
	l.Release("b", got)
	if _, err := l.Acquire("c", 3); !errors.Is(err, ErrNoCapacity) || err.Error() != "no capacity: 3 GPUs requested, 2 available (2 out of allocation: unhealthy)" {
		t.Fatalf("an excluded GPU is not capacity: %v", err)
	}
	if all, _ := l.Acquire("d", -1); !slices.Equal(all, []string{"g1", "g3"}) {
		t.Fatalf("all free GPUs leaves the excluded out: %v", all)
	}
	l.Release("d", []string{"g1", "g3"})
	// The task holding g0 keeps it (and a restart re-takes it); its release
	// does not make it allocatable.
	if err := l.Lock("a", held); err != nil {
		t.Fatalf("restore of an excluded GPU: %v", err)
	}
	l.Release("a", held)
	if got, _ := l.Acquire("e", -1); slices.Contains(got, "g0") {
		t.Fatalf("released excluded GPU was given out: %v", got)
	}
	l.Release("e", []string{"g1", "g3"})
	_, restored = l.Exclude(map[string]string{"g2": "double-bit ECC"})
	if !slices.Equal(restored, []string{"g0"}) || l.Free() != 3 || l.Excluded()["g2"] != "double-bit ECC" {
		t.Fatalf("restored %v free %d excluded %v", restored, l.Free(), l.Excluded())
	}
}
