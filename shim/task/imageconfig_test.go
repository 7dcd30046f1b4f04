package task

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/tandem-run/tandem/api"
)

// TestImageConfigOnlyOfATaskWithItsContainer: a task's image config is
// its container's image's, once the container is made; before, it is a
// conflict that says the image is not here yet; an unknown or removed
// task is not found.
func TestImageConfigOnlyOfATaskWithItsContainer(t *testing.T) {
	rt := newStepRuntime()
	e, _ := newEngine(t, rt)
	ctx := context.Background()
	if _, err := e.ImageConfig(ctx, "nope"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("unknown task: %v", err)
	}
	reached, release := rt.holdAt("create")
	defer release()
	if _, err := e.Submit(api.TaskConfig{ID: "t1", Name: "n", ImageName: "img:1"}); err != nil {
		t.Fatal(err)
	}
	<-reached
	_, err := e.ImageConfig(ctx, "t1")
	if !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), "has no container yet") {
		t.Fatalf("before the container: %v", err)
	}
	release()
	waitStatus(t, e, "t1", api.TaskRunning)
	cfg, err := e.ImageConfig(ctx, "t1")
	if err != nil || cfg.Image != "sha256:img:1" || !slices.Equal(cfg.Cmd, []string{"echo", "img:1"}) {
		t.Fatalf("running: %+v %v", cfg, err)
	}
	if _, err := e.Terminate(ctx, "t1", api.TaskTerminateRequest{}); err != nil {
		t.Fatal(err)
	}
	if err := e.Remove(ctx, "t1"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.ImageConfig(ctx, "t1"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("removed task: %v", err)
	}
}
