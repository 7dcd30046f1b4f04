package task

import "github.com/tandem-run/tandem/api"

// Recovery decisions, apart from the I/O that carries them out (recover.go)
// so that every case is a row in a table test.

// action is what recovery does with one task.
type action int

const (
	// Record-only decisions, before Docker is asked.
	actKeep       action = iota // 1: terminated and released: nothing to do
	actRelease                  // 1: terminated, resources not given back yet
	actUnreadable               // 6: the task answers terminated with the read error
	actHold                     // 3–5 pending: re-lock GPUs and volumes, settle as running, ask Docker next
	actProbe                    // 2: the record is before running: re-lock, keep its status, ask Docker next
	// Decisions once Docker answered for a held or probed task.
	actAttach          // 2 started, 3, 4: watch the container (a stopped one ends at once with its code)
	actEndGone         // 5: the container disappeared
	actFailNeverRan    // 2: no container: end executor_error
	actEndNeverStarted // 2 caught after create: remove the container, end executor_error
	actAdoptRunning    // 7: a labelled container no record names, running
	actAdoptStopped    // 7: the same, stopped
	actSkip            // a container that is ours already, unlabelled, or of a removed task
)

var actionNames = [...]string{"keep", "release", "unreadable", "hold", "probe", "attach", "end-gone", "fail-never-ran", "end-never-started", "adopt-running", "adopt-stopped", "skip"}

func (a action) String() string { return actionNames[a] }

// recordView is what a decision needs from a task record.
type recordView struct {
	readable     bool
	status       api.TaskStatus
	hasContainer bool // the record names a container id
	released     bool
}

// decideRecord is the first pass, from the record alone. A creating record
// that names its container is held like a running one: the shim may have
// died just after starting it (the record one step behind). Any other
// record before running is probed: the running step is written in the
// background, so the shim may have died with the container started and
// the server told "running" while the record still says preparing. Only
// Docker can say whether the job runs; ending it on the record's word
// would kill a job that a crash merely interrupted the bookkeeping of.
func decideRecord(r recordView) action {
	switch {
	case !r.readable:
		return actUnreadable
	case r.status == api.TaskTerminated && r.released:
		return actKeep
	case r.status == api.TaskTerminated:
		return actRelease
	case r.status == api.TaskRunning, r.status == api.TaskCreating && r.hasContainer:
		return actHold
	}
	return actProbe
}

// containerView is what Docker says of a held or probed task's container.
type containerView struct {
	found        bool // by recorded id, else by name
	neverStarted bool // created, never started
	probed       bool // the record was before running (actProbe)
}

// decideHeld settles a held or probed task once Docker answered.
func decideHeld(c containerView) action {
	switch {
	case !c.found && c.probed:
		return actFailNeverRan
	case !c.found:
		return actEndGone
	case c.neverStarted:
		return actEndNeverStarted
	}
	return actAttach
}

// strayView is a labelled container seen by the reconcile loop.
type strayView struct {
	taskID  string // its task label; "" for containers not ours
	known   bool   // a task of that id exists
	removed bool   // a tombstone names it
	running bool
	// otherShim: the container names another shim home as its creator (a
	// second shim on the host, e.g. tests); never ours to adopt.
	otherShim bool
}

// decideStray decides what to do with a container no held task claimed.
func decideStray(s strayView) action {
	switch {
	case s.taskID == "" || s.known || s.removed || s.otherShim:
		return actSkip
	case s.running:
		return actAdoptRunning
	}
	return actAdoptStopped
}
