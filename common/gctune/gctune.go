// Package gctune keeps a small Go program's heap small when it idles
// without making its collector thrash under load. A fixed soft memory
// limit does the first and not the second: once the live heap nears the
// limit, the runtime collects continuously (up to half the CPU), which
// turned a 64-task burst on the shim from a p99 of 45 ms per request into
// 324 ms. Here the limit follows the live heap: after every collection it
// is set to what the runtime holds then plus the live heap again (the
// growth GOGC=100 allows), and never below a floor. Idle, the floor rules
// and the heap stays small; under load, the collector paces as usual.
package gctune

import (
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync/atomic"
)

// Tuner moves the memory limit after each collection.
type Tuner struct {
	floor   int64
	stopped atomic.Bool
	limit   atomic.Int64 // the limit last set, for tests and logs
	samples []metrics.Sample
}

// Start sets the limit to floor and from then on after every collection to
// max(floor, held + live), where held is the memory the runtime counts
// against the limit and live the live heap. Stop ends it and leaves the
// last limit in place.
func Start(floor int64) *Tuner {
	t := &Tuner{floor: floor, samples: []metrics.Sample{
		{Name: "/memory/classes/total:bytes"},
		{Name: "/memory/classes/heap/released:bytes"},
		{Name: "/gc/heap/live:bytes"},
	}}
	t.set(floor)
	t.arm()
	return t
}

// Stop ends the tuning.
func (t *Tuner) Stop() { t.stopped.Store(true) }

func (t *Tuner) set(limit int64) {
	debug.SetMemoryLimit(limit)
	t.limit.Store(limit)
}

// arm runs tune after the next collection: a finalizer runs once its
// object was found unreachable, that is, after a collection.
func (t *Tuner) arm() {
	sentinel := new([16]byte)
	runtime.SetFinalizer(sentinel, func(*[16]byte) { t.tune() })
}

// tune is called on the finalizer goroutine after a collection.
func (t *Tuner) tune() {
	if t.stopped.Load() {
		return
	}
	metrics.Read(t.samples)
	held := int64(t.samples[0].Value.Uint64() - t.samples[1].Value.Uint64())
	live := int64(t.samples[2].Value.Uint64())
	t.set(max(t.floor, held+live))
	t.arm()
}
