package task

import (
	"context"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
)

// heldSubmit submits task "t" of image to an engine whose runtime holds
// at step, and returns once the task is there; release lets it go on.
// The cleanup ends the task and its pipeline before the temp dirs go:
// the pipeline writes the task's record there as it ends.
func heldSubmit(t *testing.T, image, step string) (e *Engine, release func()) {
	t.Helper()
	rt := newStepRuntime()
	e, _ = newEngine(t, rt)
	reached, release := rt.holdAt(step)
	t.Cleanup(func() {
		release()
		_, _ = e.Terminate(context.Background(), "t", api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser})
		e.Wait()
	})
	if _, err := e.Submit(api.TaskConfig{ID: "t", Name: "n", ImageName: image}); err != nil {
		t.Fatal(err)
	}
	<-reached
	return e, release
}

// awaitAsync runs AwaitSettled in the background and hands back its answer.
func awaitAsync(e *Engine, id string, max time.Duration) <-chan api.TaskInfoResponse {
	ch := make(chan api.TaskInfoResponse, 1)
	go func() {
		info, _ := e.AwaitSettled(context.Background(), id, max)
		ch <- info
	}()
	return ch
}

// answered is AwaitSettled's answer, failing the test with late when none
// comes within 5 s.
func answered(t *testing.T, got <-chan api.TaskInfoResponse, late string) api.TaskInfoResponse {
	t.Helper()
	select {
	case info := <-got:
		return info
	case <-time.After(5 * time.Second):
		t.Fatal(late)
		return api.TaskInfoResponse{}
	}
}

// TestAwaitSettled: a submit's answer waits for its task to run, and no
// longer than a registry pull's start, its bound, or the task's end.
func TestAwaitSettled(t *testing.T) {
	t.Run("waits until running", func(t *testing.T) {
		e, release := heldSubmit(t, "img:1", "start")
		got := awaitAsync(e, "t", time.Minute)
		select {
		case info := <-got:
			t.Fatalf("answered while the container was still starting: %+v", info)
		case <-time.After(50 * time.Millisecond):
		}
		release()
		if info := answered(t, got, "not answered once the task ran"); info.Status != api.TaskRunning {
			t.Fatalf("want running, have %+v", info)
		}
	})
	t.Run("a registry pull is not waited for", func(t *testing.T) {
		// No tag: latest is pulled even when present.
		e, _ := heldSubmit(t, "img", "pull")
		if info := answered(t, awaitAsync(e, "t", time.Minute), "a submit waited on the registry"); info.Status != api.TaskPulling {
			t.Fatalf("want pulling, have %+v", info)
		}
	})
	t.Run("bounded", func(t *testing.T) {
		e, _ := heldSubmit(t, "img:1", "create")
		info := answered(t, awaitAsync(e, "t", 30*time.Millisecond), "the bound did not end the wait")
		if info.Status == api.TaskRunning || info.Status == api.TaskTerminated {
			t.Fatalf("held in create, yet %+v", info)
		}
	})
	t.Run("ends with the task", func(t *testing.T) {
		e, release := heldSubmit(t, "img:1", "create")
		got := awaitAsync(e, "t", time.Minute)
		go func() {
			_, _ = e.Terminate(context.Background(), "t", api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser})
		}()
		time.Sleep(20 * time.Millisecond)
		release()
		if info := answered(t, got, "a terminated task's submit still waited"); info.Status != api.TaskTerminated {
			t.Fatalf("want terminated, have %+v", info)
		}
	})
	t.Run("unknown task", func(t *testing.T) {
		e, _ := newEngine(t, newStepRuntime())
		if _, err := e.AwaitSettled(context.Background(), "nope", time.Second); err != ErrNotFound {
			t.Fatalf("want ErrNotFound, have %v", err)
		}
	})
}
