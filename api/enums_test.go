package api

import "testing"

func TestTaskStatusTransitions(t *testing.T) {
	all := []TaskStatus{TaskPending, TaskPreparing, TaskPulling, TaskCreating, TaskRunning, TaskTerminated}
	allowed := map[[2]TaskStatus]bool{
		{TaskPending, TaskPreparing}:  true,
		{TaskPreparing, TaskPulling}:  true,
		{TaskPulling, TaskCreating}:   true,
		{TaskCreating, TaskRunning}:   true,
		{TaskRunning, TaskRunning}:    true,
		{TaskPending, TaskTerminated}: true, {TaskPreparing, TaskTerminated}: true, {TaskPulling, TaskTerminated}: true,
		{TaskCreating, TaskTerminated}: true, {TaskRunning, TaskTerminated}: true, {TaskTerminated, TaskTerminated}: true,
	}
	for _, from := range all {
		for _, to := range all {
			if got, want := from.CanTransitionTo(to), allowed[[2]TaskStatus{from, to}]; got != want {
				t.Errorf("%s -> %s: got %v want %v", from, to, got, want)
			}
		}
	}
	if TaskStatus("").CanTransitionTo(TaskRunning) || TaskStatus("bogus").Valid() {
		t.Fatal("unknown statuses must not transition or validate")
	}
}

func TestTerminationReasonValid(t *testing.T) {
	for _, r := range []TerminationReason{ReasonExecutorError, ReasonDoneByRunner, ReasonLogQuotaExceeded, ReasonTerminatedByUtilization} {
		if !r.Valid() {
			t.Errorf("%q should be valid", r)
		}
	}
	for _, r := range []TerminationReason{"", "EXECUTOR_ERROR", "done", "container_exited"} {
		if r.Valid() {
			t.Errorf("%q must not be valid", r)
		}
	}
}

func TestJobStateFinal(t *testing.T) {
	for s, want := range map[JobState]bool{JobRunning: false, JobTerminating: false, JobDone: true, JobFailed: true, JobTerminated: true} {
		if s.Final() != want {
			t.Errorf("%s.Final() = %v", s, !want)
		}
	}
}

func TestJobTransitions(t *testing.T) {
	all := []JobState{"", JobRunning, JobDone, JobFailed, JobTerminated, JobTerminating}
	allowed := map[[2]JobState]bool{
		{"", JobRunning}: true, {JobRunning, JobDone}: true, {JobRunning, JobFailed}: true, {JobRunning, JobTerminated}: true,
		{"", JobFailed}: true, {"", JobTerminated}: true,
	}
	for _, prev := range all {
		for _, next := range all {
			if next == "" {
				continue
			}
			if got := next.CanFollow(prev); got != allowed[[2]JobState{prev, next}] {
				t.Errorf("%q -> %q: %v", prev, next, got)
			}
		}
	}
}
