package ctl

import (
	"fmt"
	"time"

	"github.com/tandem-run/tandem/api"
)

// EventKind says what an Event reports.
type EventKind int

const (
	// EventInfo is a progress line (a shim answered, the job runs, ...).
	EventInfo EventKind = iota
	// EventTaskLeft must reach the user even where progress is not shown
	// (machine-readable output): the run could not remove its task (Task,
	// Name on Shim; Node in a multi-node run) because of Err.
	EventTaskLeft
	// EventPhaseDone says a task left a status: Status, after Took.
	EventPhaseDone
	// EventReady says the wait for a task ended: it is Status (running or
	// terminated) Took after submit.
	EventReady
	// EventPull is image pull progress of a pulling task: Pull, Image.
	EventPull
	// EventStopping says a stop (Run.Stop) is under way gracefully: Text
	// says what stops; a second stop, or the context's end, kills it. The
	// caller words how its user gives that second stop.
	EventStopping
)

// Event is one step of a run, for the caller to render as it likes; the
// library writes and draws no progress itself.
type Event struct {
	Kind   EventKind
	Task   string         // task id, short
	Status api.TaskStatus // EventPhaseDone, EventReady
	Took   time.Duration  // EventPhaseDone, EventReady
	Image  string         // EventPull
	Pull   *api.ImagePullProgress
	Text   string // EventInfo
	Shim   string // EventTaskLeft
	Name   string // EventTaskLeft
	Node   string // EventTaskLeft in a multi-node run: the node's label
	Err    error  // EventTaskLeft
	// Concurrent: several runs report at once (a multi-node run), so a
	// renderer must not redraw lines in place.
	Concurrent bool
}

// say is where a verb says what it does: a Config's Progress; nil says
// nothing.
type say func(Event)

func (s say) emit(e Event) {
	if s != nil {
		s(e)
	}
}

func (s say) status(format string, args ...any) {
	s.emit(Event{Kind: EventInfo, Text: fmt.Sprintf(format, args...)})
}
