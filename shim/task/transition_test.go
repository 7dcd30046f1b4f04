package task

import (
	"errors"
	"testing"

	"github.com/tandem-run/tandem/api"
)

func TestApplyLocked(t *testing.T) {
	stop := &api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser, TerminationMessage: "bye"}
	stopNoReason := &api.TaskTerminateRequest{}
	cases := []struct {
		name       string
		from       api.TaskStatus
		reason     api.TerminationReason
		stopReq    *api.TaskTerminateRequest
		c          change
		wantErr    bool
		wantStatus api.TaskStatus
		wantReason api.TerminationReason
		wantMsg    string
	}{
		{name: "pipeline step", from: api.TaskPending, c: change{to: api.TaskPreparing}, wantStatus: api.TaskPreparing},
		{name: "step skipping a stage", from: api.TaskPending, c: change{to: api.TaskCreating}, wantErr: true, wantStatus: api.TaskPending},
		{name: "back to pending", from: api.TaskPulling, c: change{to: api.TaskPending}, wantErr: true, wantStatus: api.TaskPulling},
		{name: "running again commits ports", from: api.TaskRunning, c: change{to: api.TaskRunning}, wantStatus: api.TaskRunning},
		{name: "terminated cannot run", from: api.TaskTerminated, reason: api.ReasonDoneByRunner, c: change{to: api.TaskRunning},
			wantErr: true, wantStatus: api.TaskTerminated, wantReason: api.ReasonDoneByRunner},
		{name: "a pending stop blocks a step", from: api.TaskCreating, stopReq: stop, c: change{to: api.TaskRunning}, wantErr: true, wantStatus: api.TaskCreating},
		{name: "recovery settles despite a stop", from: api.TaskCreating, stopReq: stop, c: change{to: api.TaskRunning, recovered: true}, wantStatus: api.TaskRunning},
		{name: "recovery skips to running (the record lagged the container)", from: api.TaskPulling, c: change{to: api.TaskRunning, recovered: true}, wantStatus: api.TaskRunning},
		{name: "recovery never revives a terminated task", from: api.TaskTerminated, c: change{to: api.TaskRunning, recovered: true}, wantErr: true, wantStatus: api.TaskTerminated},
		{name: "the pipeline may not skip", from: api.TaskPulling, c: change{to: api.TaskRunning}, wantErr: true, wantStatus: api.TaskPulling},
		{name: "end with the pipeline's reason", from: api.TaskRunning, c: change{to: api.TaskTerminated, reason: api.ReasonDoneByRunner},
			wantStatus: api.TaskTerminated, wantReason: api.ReasonDoneByRunner},
		{name: "a stop's reason beats the pipeline's", from: api.TaskPulling, stopReq: stop, c: change{to: api.TaskTerminated, reason: api.ReasonCreatingContainerError, msg: "x"},
			wantStatus: api.TaskTerminated, wantReason: api.ReasonTerminatedByUser, wantMsg: "bye"},
		{name: "a stop without a reason is the server's", from: api.TaskRunning, stopReq: stopNoReason, c: change{to: api.TaskTerminated, reason: api.ReasonDoneByRunner},
			wantStatus: api.TaskTerminated, wantReason: api.ReasonTerminatedByServer},
		{name: "never an empty reason", from: api.TaskRunning, c: change{to: api.TaskTerminated},
			wantStatus: api.TaskTerminated, wantReason: api.ReasonExecutorError},
		{name: "the first reason stays", from: api.TaskTerminated, reason: api.ReasonDoneByRunner, c: change{to: api.TaskTerminated, reason: api.ReasonExecutorError, msg: "late"},
			wantStatus: api.TaskTerminated, wantReason: api.ReasonDoneByRunner},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tk := &task{status: tc.from, reason: tc.reason, stopReq: tc.stopReq}
			updated := false
			tc.c.update = func() { updated = true }
			err := applyLocked(tk, tc.c)
			if (err != nil) != tc.wantErr {
				t.Fatalf("err = %v, want error: %v", err, tc.wantErr)
			}
			if err != nil && !errors.Is(err, errTransition) {
				t.Fatalf("a refusal is errTransition, got %v", err)
			}
			if tk.status != tc.wantStatus || tk.reason != tc.wantReason || tk.message != tc.wantMsg {
				t.Fatalf("got %s/%s/%q, want %s/%s/%q", tk.status, tk.reason, tk.message, tc.wantStatus, tc.wantReason, tc.wantMsg)
			}
			kept := tc.from == api.TaskTerminated && tc.reason != ""
			if wantUpdate := !tc.wantErr && !kept; updated != wantUpdate {
				t.Fatalf("update applied: %v, want %v (only with a change that is made)", updated, wantUpdate)
			}
		})
	}
}

func TestTransitionPersistsAndClosesDone(t *testing.T) {
	e, _ := newEngine(t, &stepRuntime{})
	tk := &task{cfg: api.TaskConfig{ID: "t1", Name: "n"}, name: "n-1", status: api.TaskRunning, done: make(chan struct{})}
	e.mu.Lock()
	e.tasks["t1"] = tk
	e.mu.Unlock()

	if err := e.transition(tk, change{to: api.TaskTerminated, reason: api.ReasonDoneByRunner, persist: persistSoon}); err != nil {
		t.Fatal(err)
	}
	e.Sync()
	select {
	case <-tk.done:
		t.Fatal("done closed by a change that is not the last")
	default:
	}
	loaded, err := e.recs.load()
	if err != nil || len(loaded) != 1 || loaded[0].rec.Status != api.TaskTerminated || loaded[0].rec.Reason != api.ReasonDoneByRunner {
		t.Fatalf("record after persistSoon: %+v, %v", loaded, err)
	}
	// The last change closes done even when it changes nothing (the reason
	// was already recorded), and twice is harmless.
	for range 2 {
		if err := e.transition(tk, change{to: api.TaskTerminated, reason: api.ReasonExecutorError, last: true}); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case <-tk.done:
	default:
		t.Fatal("done not closed by the last change")
	}
	if err := e.transition(tk, change{to: api.TaskRunning, last: true}); !errors.Is(err, errTransition) {
		t.Fatalf("running after terminated: %v", err)
	}
}
