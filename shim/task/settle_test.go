package task

import (
	"context"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
)

// awaitAsync runs AwaitSettled in the background and hands back its answer.
func awaitAsync(e *Engine, id string, max time.Duration) <-chan api.TaskInfoResponse {
	ch := make(chan api.TaskInfoResponse, 1)
	go func() {
		info, _ := e.AwaitSettled(context.Background(), id, max)
		ch <- info
	}()
	return ch
}

// settleCleanup ends the test's task and its pipeline before the temp
// dirs go: the pipeline writes the task's record there as it ends.
func settleCleanup(t *testing.T, e *Engine, release func()) {
	t.Cleanup(func() {
		release()
		_, _ = e.Terminate(context.Background(), "t", api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser})
		e.Wait()
	})
}

// TestAwaitSettled: a submit's answer waits for its task to run, and no
// longer than a registry pull's start, its bound, or the task's end.
func TestAwaitSettled(t *testing.T) {
	t.Run("waits until running", func(t *testing.T) {
		rt := newStepRuntime()
		e, _ := newEngine(t, rt)
		reached, release := rt.holdAt("start")
		settleCleanup(t, e, release)
		if _, err := e.Submit(api.TaskConfig{ID: "t", Name: "n", ImageName: "img:1"}); err != nil {
			t.Fatal(err)
		}
		<-reached
		got := awaitAsync(e, "t", time.Minute)
		select {
		case info := <-got:
			t.Fatalf("answered while the container was still starting: %+v", info)
		case <-time.After(50 * time.Millisecond):
		}
		release()
		select {
		case info := <-got:
			if info.Status != api.TaskRunning {
				t.Fatalf("want running, have %+v", info)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("not answered once the task ran")
		}
	})
	t.Run("a registry pull is not waited for", func(t *testing.T) {
		rt := newStepRuntime()
		e, _ := newEngine(t, rt)
		reached, release := rt.holdAt("pull")
		settleCleanup(t, e, release)
		// No tag: latest is pulled even when present.
		if _, err := e.Submit(api.TaskConfig{ID: "t", Name: "n", ImageName: "img"}); err != nil {
			t.Fatal(err)
		}
		<-reached
		select {
		case info := <-awaitAsync(e, "t", time.Minute):
			if info.Status != api.TaskPulling {
				t.Fatalf("want pulling, have %+v", info)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("a submit waited on the registry")
		}
	})
	t.Run("bounded", func(t *testing.T) {
		rt := newStepRuntime()
		e, _ := newEngine(t, rt)
		reached, release := rt.holdAt("create")
		settleCleanup(t, e, release)
		if _, err := e.Submit(api.TaskConfig{ID: "t", Name: "n", ImageName: "img:1"}); err != nil {
			t.Fatal(err)
		}
		<-reached
		select {
		case info := <-awaitAsync(e, "t", 30*time.Millisecond):
			if info.Status == api.TaskRunning || info.Status == api.TaskTerminated {
				t.Fatalf("held in create, yet %+v", info)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("the bound did not end the wait")
		}
	})
	t.Run("ends with the task", func(t *testing.T) {
		rt := newStepRuntime()
		e, _ := newEngine(t, rt)
		reached, release := rt.holdAt("create")
		settleCleanup(t, e, release)
		if _, err := e.Submit(api.TaskConfig{ID: "t", Name: "n", ImageName: "img:1"}); err != nil {
			t.Fatal(err)
		}
		<-reached
		got := awaitAsync(e, "t", time.Minute)
		go func() {
			_, _ = e.Terminate(context.Background(), "t", api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser})
		}()
		time.Sleep(20 * time.Millisecond)
		release()
		select {
		case info := <-got:
			if info.Status != api.TaskTerminated {
				t.Fatalf("want terminated, have %+v", info)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("a terminated task's submit still waited")
		}
	})
	t.Run("unknown task", func(t *testing.T) {
		e, _ := newEngine(t, newStepRuntime())
		if _, err := e.AwaitSettled(context.Background(), "nope", time.Second); err != ErrNotFound {
			t.Fatalf("want ErrNotFound, have %v", err)
		}
	})
}
