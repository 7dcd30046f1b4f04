// Which task holds which GPU (the package doc is in gpu.go).

package gpu

import (
	"errors"
	"fmt"
	"slices"
	"sync"
)

// ErrNoCapacity is returned when fewer GPUs are free than requested.
var ErrNoCapacity = errors.New("no capacity")

// Locks is the GPU lock table. Allocation is deterministic and keeps a
// task's GPUs close: the first NUMA node (in discovery order) that can hold
// the whole request, else the lowest free indices. A GPU taken out of
// allocation (Exclude: its health turned critical, or it vanished) is given
// to no new task; a task that holds it keeps it until its release.
type Locks struct {
	mu       sync.Mutex // guards holder and excluded
	ids      []string
	node     map[string]int    // gpu id → NUMA node (-1 unknown)
	holder   map[string]string // gpu id → task id ("" = free)
	excluded map[string]string // gpu id → why it is out of allocation
}

// NewLocks returns a table of the given GPU ids, all free, no topology.
func NewLocks(ids []string) *Locks {
	l := &Locks{ids: slices.Clone(ids), node: map[string]int{}, holder: make(map[string]string, len(ids)), excluded: map[string]string{}}
	for _, id := range ids {
		l.holder[id] = ""
		l.node[id] = -1
	}
	return l
}

// NewLocksFor returns a table of the discovered GPUs with their topology.
func NewLocksFor(gpus []GPU) *Locks {
	ids := make([]string, 0, len(gpus))
	for _, g := range gpus {
		ids = append(ids, g.ID)
	}
	l := NewLocks(ids)
	for _, g := range gpus {
		l.node[g.ID] = g.NUMANode
	}
	return l
}

// Acquire locks GPUs for task: n > 0 exactly n (all or nothing), -1 all free
// ones (possibly none). The result is never nil.
func (l *Locks) Acquire(task string, n int) ([]string, error) {
	if n == 0 || n < -1 {
		return nil, fmt.Errorf("invalid GPU count %d", n)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	free := make([]string, 0, len(l.ids))
	for _, id := range l.ids {
		if l.holder[id] == "" && l.excluded[id] == "" {
			free = append(free, id)
		}
	}
	if n > 0 {
		if len(free) < n {
			if len(l.excluded) > 0 {
				return nil, fmt.Errorf("%w: %d GPUs requested, %d available (%d out of allocation: unhealthy)", ErrNoCapacity, n, len(free), len(l.excluded))
			}
			return nil, fmt.Errorf("%w: %d GPUs requested, %d available", ErrNoCapacity, n, len(free))
		}
		free = l.closest(free, n)
	}
	for _, id := range free {
		l.holder[id] = task
	}
	return free, nil
}

// Lock re-takes specific GPUs for task (restoring state); ids held by another
// task are reported, unknown ids ignored. An excluded GPU is re-taken too:
// the task that had it keeps it.
func (l *Locks) Lock(task string, ids []string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, id := range ids {
		h, ok := l.holder[id]
		if !ok {
			continue
		}
		if h != "" && h != task {
			return fmt.Errorf("GPU %s is held by task %s", id, h)
		}
		l.holder[id] = task
	}
	return nil
}

// Release frees the GPUs task holds among ids. GPUs since given to another
// task are left alone, so a late or repeated release cannot free them.
func (l *Locks) Release(task string, ids []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, id := range ids {
		if l.holder[id] == task {
			l.holder[id] = ""
		}
	}
}

// Total returns the number of GPUs.
func (l *Locks) Total() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.holder)
}

// Free returns the number of GPUs a new task can get: unlocked and not
// excluded.
func (l *Locks) Free() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for id, h := range l.holder {
		if h == "" && l.excluded[id] == "" {
			n++
		}
	}
	return n
}

// Exclude sets which GPUs are out of allocation (id → why; unknown ids are
// ignored), replacing the previous set: a GPU left out of out is
// allocatable again. It returns the ids that went out and came back, in
// discovery order, so that the caller logs each change once.
func (l *Locks) Exclude(out map[string]string) (added, restored []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, id := range l.ids {
		why, was := out[id], l.excluded[id] != ""
		switch {
		case why != "" && !was:
			added = append(added, id)
		case why == "" && was:
			restored = append(restored, id)
		}
	}
	l.excluded = map[string]string{}
	for id, why := range out {
		if _, ok := l.holder[id]; ok && why != "" {
			l.excluded[id] = why
		}
	}
	return added, restored
}

// Excluded returns the GPUs out of allocation and why.
func (l *Locks) Excluded() map[string]string {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make(map[string]string, len(l.excluded))
	for id, why := range l.excluded {
		out[id] = why
	}
	return out
}

// closest picks n of the free ids: all from one NUMA node when one node has
// enough (the first such node in discovery order), else the first n.
func (l *Locks) closest(free []string, n int) []string {
	byNode := map[int][]string{}
	var order []int
	for _, id := range free {
		nd := l.node[id]
		if nd < 0 {
			continue
		}
		if _, ok := byNode[nd]; !ok {
			order = append(order, nd)
		}
		byNode[nd] = append(byNode[nd], id)
	}
	for _, nd := range order {
		if len(byNode[nd]) >= n {
			return byNode[nd][:n]
		}
	}
	return free[:n]
}
