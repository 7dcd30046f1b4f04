package ctl

import (
	"fmt"
	"strings"
	"time"

	"github.com/tandem-run/tandem/api"
)

// EventKind says what an Event reports.
type EventKind int

const (
	// EventInfo is a progress line (a shim answered, the job runs, ...).
	EventInfo EventKind = iota
	// EventNotice must reach the user even where progress is not shown
	// (machine-readable output): a task left behind, with how to remove it.
	EventNotice
	// EventPhaseDone says a task left a status: Status, after Took.
	EventPhaseDone
	// EventReady says the wait for a task ended: it is Status (running or
	// terminated) Took after submit.
	EventReady
	// EventPull is image pull progress of a pulling task: Pull, Image.
	EventPull
)

// Event is one step of a run, for the caller to show as it likes; the
// library writes no progress itself.
type Event struct {
	Kind   EventKind
	Task   string         // task id, short
	Status api.TaskStatus // EventPhaseDone, EventReady
	Took   time.Duration  // EventPhaseDone, EventReady
	Image  string         // EventPull
	Pull   *api.ImagePullProgress
	Text   string // EventInfo, EventNotice
	// Concurrent: several runs report at once (a multi-node run), so a
	// renderer must not redraw lines in place.
	Concurrent bool
}

// String is the event as one line of text.
func (e Event) String() string {
	switch e.Kind {
	case EventPhaseDone:
		return fmt.Sprintf("task %s: %s done in %.2fs", e.Task, e.Status, e.Took.Seconds())
	case EventReady:
		return fmt.Sprintf("task %s: %s after %.2fs", e.Task, e.Status, e.Took.Seconds())
	case EventPull:
		if e.Pull == nil {
			return "  pulling " + e.Image
		}
		return fmt.Sprintf("  pulling %s: %s", e.Image, progressBar(e.Pull.DownloadedBytes, e.Pull.TotalBytes, e.Pull.IsTotalBytesFinal))
	}
	return e.Text
}

// progressBar draws done/total as 24 cells and MiB; "+" while the total
// may still grow.
func progressBar(done, total int64, final bool) string {
	const width = 24
	n := int(float64(width) * float64(done) / float64(max(total, 1)))
	n = min(max(n, 0), width)
	suffix := ""
	if !final {
		suffix = "+"
	}
	return fmt.Sprintf("[%s%s] %d/%d%s MiB", strings.Repeat("#", n), strings.Repeat("-", width-n), done>>20, total>>20, suffix)
}

// emit hands e to o.Progress, if any.
func (o RunOptions) emit(e Event) {
	if o.Progress != nil {
		o.Progress(e)
	}
}

func (o RunOptions) status(format string, args ...any) {
	o.emit(Event{Kind: EventInfo, Text: fmt.Sprintf(format, args...)})
}

// statusAlways reports what the user must read even when progress is not
// shown (EventNotice).
func (o RunOptions) statusAlways(format string, args ...any) {
	o.emit(Event{Kind: EventNotice, Text: fmt.Sprintf(format, args...)})
}

// progressWriter turns lines written by helpers that take a writer into
// EventInfo events.
type progressWriter struct{ o RunOptions }

func (w progressWriter) Write(p []byte) (int, error) {
	for _, line := range strings.Split(strings.TrimRight(string(p), "\n"), "\n") {
		w.o.emit(Event{Kind: EventInfo, Text: line})
	}
	return len(p), nil
}
