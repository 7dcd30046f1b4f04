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
		{"not ours", strayView{}, actSkip},
		{"a task we have", strayView{taskID: "a", known: true, running: true}, actSkip},
		{"removed (tombstone): never again", strayView{taskID: "a", removed: true, running: true}, actSkip},
		{"another shim's container", strayView{taskID: "a", running: true, otherShim: true}, actSkip},
		{"no record, running", strayView{taskID: "a", running: true}, actAdoptRunning},
		{"no record, stopped", strayView{taskID: "a"}, actAdoptStopped},
	}
	for _, tc := range tests {
		if got := decideStray(tc.s); got != tc.want {
			t.Errorf("%s: %s, want %s", tc.name, got, tc.want)
		}
	}
}
