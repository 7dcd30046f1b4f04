package task

import "time"

// Tombstones remember removed task ids so that nothing brings them back.
// The reconcile loop lists containers, then adopts labelled ones no task
// names; a list taken just before a Remove still shows the removed task's
// container, and without a tombstone the task would be adopted again (and
// its record rewritten). A tombstone is written under Engine.mu in the same
// step that deletes the task, and adopt checks it under the same lock, so
// no ordering of list, remove and adopt can resurrect a task.
//
// Tombstones are bounded: at most maxTombstones, each kept tombstoneTTL
// (a stale list is seconds old; an hour is far beyond any reconcile tick).
const (
	maxTombstones = 4096
	tombstoneTTL  = time.Hour
)

// bury records id as removed. Caller holds e.mu.
func (e *Engine) bury(id string) {
	if e.tombstones == nil {
		e.tombstones = map[string]time.Time{}
	}
	now := e.now()
	if len(e.tombstones) >= maxTombstones {
		oldestID, oldest := "", now
		for k, at := range e.tombstones {
			if now.Sub(at) > tombstoneTTL {
				delete(e.tombstones, k)
				continue
			}
			if at.Before(oldest) {
				oldestID, oldest = k, at
			}
		}
		if len(e.tombstones) >= maxTombstones {
			delete(e.tombstones, oldestID)
		}
	}
	e.tombstones[id] = now
}

// buried reports whether id was removed recently. Caller holds e.mu.
func (e *Engine) buried(id string) bool {
	at, ok := e.tombstones[id]
	return ok && e.now().Sub(at) <= tombstoneTTL
}
