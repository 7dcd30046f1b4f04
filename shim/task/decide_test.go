package task

import (
	"testing"

	"github.com/tandem-run/tandem/api"
)

func TestDecideRecord(t *testing.T) {
	tests := []struct {
		name string
		r    recordView
		want action
	}{
		{"unreadable", recordView{}, actUnreadable},
		{"terminated, released", recordView{readable: true, status: api.TaskTerminated, released: true}, actKeep},
		{"terminated, shim died before release", recordView{readable: true, status: api.TaskTerminated}, actRelease},
		{"running", recordView{readable: true, status: api.TaskRunning, hasContainer: true}, actHold},
		{"running, record without id (older write)", recordView{readable: true, status: api.TaskRunning}, actHold},
		{"creating, container id recorded (record one step behind)", recordView{readable: true, status: api.TaskCreating, hasContainer: true}, actHold},
		{"creating, no container id yet", recordView{readable: true, status: api.TaskCreating}, actProbe},
		{"pending", recordView{readable: true, status: api.TaskPending}, actProbe},
		{"preparing (running not written yet)", recordView{readable: true, status: api.TaskPreparing}, actProbe},
		{"pulling", recordView{readable: true, status: api.TaskPulling}, actProbe},
	}
	for _, tc := range tests {
		if got := decideRecord(tc.r); got != tc.want {
			t.Errorf("%s: %s, want %s", tc.name, got, tc.want)
		}
	}
}

func TestDecideHeld(t *testing.T) {
	tests := []struct {
		name string
		c    containerView
		want action
	}{
		{"container gone", containerView{}, actEndGone},
		{"created, never started (shim died between create and start)", containerView{found: true, neverStarted: true}, actEndNeverStarted},
		{"running or stopped: watched (a stopped one ends with its code)", containerView{found: true}, actAttach},
		{"probed, no container: the pipeline died before create", containerView{probed: true}, actFailNeverRan},
		{"probed, created, never started", containerView{found: true, neverStarted: true, probed: true}, actEndNeverStarted},
		{"probed, started: the record lagged, the job runs", containerView{found: true, probed: true}, actAttach},
	}
	for _, tc := range tests {
		if got := decideHeld(tc.c); got != tc.want {
			t.Errorf("%s: %s, want %s", tc.name, got, tc.want)
		}
	}
}

func TestDecideStray(t *testing.T) {
	tests := []struct {
		name string
		s    strayView
		want action
	}{
		{"no task id", strayView{}, actSkip},
		{"no task id, foreign", strayView{foreign: true}, actSkip},
		{"a task we have", strayView{taskID: "a", known: true, running: true}, actSkip},
		{"removed (tombstone): never again", strayView{taskID: "a", removed: true, running: true}, actSkip},
		{"another agent's container", strayView{taskID: "a", running: true, foreign: true}, actLeaveForeign},
		{"another agent's, stopped", strayView{taskID: "a", foreign: true}, actLeaveForeign},
		{"another agent's, same task id as one of ours", strayView{taskID: "a", known: true, running: true, foreign: true}, actLeaveForeign},
		{"no record, running", strayView{taskID: "a", running: true}, actAdoptRunning},
		{"no record, stopped", strayView{taskID: "a"}, actAdoptStopped},
	}
	for _, tc := range tests {
		if got := decideStray(tc.s); got != tc.want {
			t.Errorf("%s: %s, want %s", tc.name, got, tc.want)
		}
	}
}

// The rule of whose a container is: labelled with our home, ours;
// labelled with another, never; unlabelled, ours only when its runner dir
// says it was made with our home (the migration from dstack's shim) or the
// operator asked (--adopt-unlabeled).
func TestOwnerAndAdoptable(t *testing.T) {
	const home = "/root/.dstack"
	tests := []struct {
		name              string
		label, runnerDir  string
		home              string
		want              owner
		adopted, withFlag bool
	}{
		{"labelled with our home", home, "", home, ownerSelf, true, true},
		{"labelled with our home, written unclean", home + "/", "/elsewhere/runners/x", home, ownerSelf, true, true},
		{"labelled with another home", "/tmp/scratch", "", home, ownerOther, false, false},
		{"labelled with another home, runner dir under ours", "/tmp/scratch", home + "/runners/x", home, ownerOther, false, false},
		{"dstack's shim with our home (migration)", "", home + "/runners/task-1a2b3c4d", home, ownerSameHome, true, true},
		{"dstack's shim on COS, we run with its home", "", "/etc/.dstack/runners/t-0", "/etc/.dstack", ownerSameHome, true, true},
		{"dstack's task beside a scratch-home shim", "", home + "/runners/task-1a2b3c4d", "/tmp/scratch", ownerUnlabelled, false, true},
		{"unlabelled, no runner dir", "", "", home, ownerUnlabelled, false, true},
		{"unlabelled, runner dir deeper under our home", "", home + "/runners/a/b", home, ownerUnlabelled, false, true},
		{"unlabelled, runner dir is our runners dir itself", "", home + "/runners", home, ownerUnlabelled, false, true},
		{"unlabelled, runner dir climbs out of ours", "", home + "/runners/../../x/runners/y", home, ownerUnlabelled, false, true},
		{"unlabelled, a home that is a prefix of ours", "", "/root/.dstack2/runners/x", home, ownerUnlabelled, false, true},
		{"unlabelled, this shim has no home", "", "/runners/x", "", ownerUnlabelled, false, true},
	}
	for _, tc := range tests {
		got := ownerOf(tc.label, tc.runnerDir, tc.home)
		if got != tc.want {
			t.Errorf("%s: %s, want %s", tc.name, got, tc.want)
		}
		if a := adoptable(got, false); a != tc.adopted {
			t.Errorf("%s: adoptable %v, want %v", tc.name, a, tc.adopted)
		}
		if a := adoptable(got, true); a != tc.withFlag {
			t.Errorf("%s: adoptable with --adopt-unlabeled %v, want %v", tc.name, a, tc.withFlag)
		}
	}
}
