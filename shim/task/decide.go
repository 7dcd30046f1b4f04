package task

import (
	"path/filepath"

	"github.com/tandem-run/tandem/api"
)

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
	actAdoptRunning    // 7: a container of this shim no record names, running
	actAdoptStopped    // 7: the same, stopped
	actSkip            // a container that is ours already, has no task id, or of a removed task
	actLeaveForeign    // another agent's container: left alone, its GPUs kept from our tasks
)

var actionNames = [...]string{"keep", "release", "unreadable", "hold", "probe", "attach", "end-gone", "fail-never-ran", "end-never-started", "adopt-running", "adopt-stopped", "skip", "leave-foreign"}

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

// owner is whose a task container is, read from its labels and its runner
// dir. A shim beside other agents on one Docker (dstack's own shim running
// the dstack server's tasks, a second shim with a scratch home) sees their
// task containers too: they carry the same dstack labels, and adopting them
// put tasks the user never ran in `tandem ps -a`, for `tandem prune` to
// remove.
type owner int

const (
	// ownerSelf: labelled with this shim's home.
	ownerSelf owner = iota
	// ownerSameHome: no home label, its runner dir under this shim's home:
	// made by a shim that ran with this home (dstack's, which this one
	// replaces, or a Tandem shim from before the label). Adopted: the
	// migration keeps the tasks running on a live host.
	ownerSameHome
	// ownerUnlabelled: no home label and a runner dir elsewhere (another
	// agent's); adopted only when the operator asks (--adopt-unlabeled).
	ownerUnlabelled
	// ownerOther: labelled with another shim's home; never adopted.
	ownerOther
)

var ownerNames = [...]string{"self", "same-home", "unlabelled", "other-home"}

func (o owner) String() string { return ownerNames[o] }

// ownerOf classifies a container by its LabelShimHome (labelHome) and the
// host side of its runner-dir bind (runnerDir), for a shim at home. dstack's
// shim binds <its home>/runners/<container name> at /tmp/runner, so the bind
// says which home made an unlabelled container: no guess from the home's
// path (/root/.dstack, /etc/.dstack on COS, a scratch dir) is needed.
func ownerOf(labelHome, runnerDir, home string) owner {
	switch {
	case labelHome != "" && filepath.Clean(labelHome) == filepath.Clean(home):
		return ownerSelf
	case labelHome != "":
		return ownerOther
	case home != "" && runnerDir != "" && filepath.Dir(filepath.Clean(runnerDir)) == filepath.Join(home, "runners"):
		return ownerSameHome
	}
	return ownerUnlabelled
}

// adoptable says whether a shim may take a container of owner o as one of
// its tasks: list it, stop it, remove it. adoptUnlabelled is the operator's
// --adopt-unlabeled.
func adoptable(o owner, adoptUnlabelled bool) bool {
	return o == ownerSelf || o == ownerSameHome || o == ownerUnlabelled && adoptUnlabelled
}

// strayView is a labelled container seen by the reconcile loop.
type strayView struct {
	taskID  string // its task label; "" for containers not ours
	known   bool   // a task of that id exists
	removed bool   // a tombstone names it
	running bool
	// foreign: another agent's container (adoptable is false for its
	// owner): never listed, stopped or removed; only the GPUs it holds
	// are kept from this shim's tasks.
	foreign bool
}

// decideStray decides what to do with a container no held task claimed.
func decideStray(s strayView) action {
	switch {
	case s.taskID == "":
		return actSkip
	case s.foreign:
		return actLeaveForeign
	case s.known || s.removed:
		return actSkip
	case s.running:
		return actAdoptRunning
	}
	return actAdoptStopped
}
