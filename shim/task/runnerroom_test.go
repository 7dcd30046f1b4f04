package task

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/shim/runnerdir"
)

// A submit whose runner dir has no room on the home's disk is refused
// before anything is written (no task, no record, no container); once the
// room is there the same submit runs, its dir sized to the room, and
// removing it gives the room back.
func TestSubmitWithoutRoomForItsRunnerDirIsRefused(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("runner dirs of their own need root (loop devices)")
	}
	var mu sync.Mutex
	free := int64(64 << 20) // the floor of a 640 MiB disk: no room
	dirs := &runnerdir.Dirs{Size: runnerdir.DefaultSize, Statfs: func(string) (runnerdir.Space, error) {
		mu.Lock()
		defer mu.Unlock()
		return runnerdir.Space{Free: free, Total: 640 << 20}, nil
	}}
	t.Cleanup(dirs.Close)
	rt := newStepRuntime()
	home := t.TempDir()
	runner := filepath.Join(t.TempDir(), "runner")
	_ = os.WriteFile(runner, nil, 0o755)
	e := New(Config{Home: home, RunnerBinary: runner, RunnerHTTPPort: 10999, RunnerSSHPort: 10022,
		RunnerLogLevel: "info", InfinibandPath: "/nonexistent/ib", TerminateWait: 5 * time.Second, RunnerDirs: dirs},
		rt, nil, nil, logging.Discard())
	t.Cleanup(func() { e.Shutdown(); e.Sync() })
	cfg := api.TaskConfig{ID: "t1", Name: "n", ImageName: "img"}

	_, err := e.Submit(cfg)
	if !errors.Is(err, runnerdir.ErrNoRoom) {
		t.Fatalf("submit with no room: %v", err)
	}
	if _, err := e.Get(cfg.ID); !errors.Is(err, ErrNotFound) || rt.live() != 0 {
		t.Fatalf("a refused submit left a task (%v) or a container (%d)", err, rt.live())
	}
	if entries, _ := os.ReadDir(filepath.Join(home, "tasks")); len(entries) != 0 {
		t.Fatalf("a refused submit wrote %v", entries)
	}
	if _, err := os.Stat(filepath.Join(home, "runners")); !os.IsNotExist(err) {
		t.Fatalf("a refused submit made the runners dir: %v", err)
	}

	mu.Lock()
	free = 64<<20 + 60<<20 // 60 MiB above the floor: a dir of 30
	mu.Unlock()
	if _, err := e.Submit(cfg); err != nil {
		t.Fatalf("submit with room: %v", err)
	}
	waitStatus(t, e, cfg.ID, api.TaskRunning)
	img := filepath.Join(home, "runners", ContainerName(cfg.Name, cfg.ID)) + ".ext4"
	if fi, err := os.Stat(img); err != nil || fi.Size() != 30<<20 {
		t.Fatalf("its runner dir's image: %v", err)
	}
	// The first dir claims its 30 MiB: a second gets the least, a third
	// is refused.
	if _, err := e.Submit(api.TaskConfig{ID: "t2", Name: "n", ImageName: "img"}); err != nil {
		t.Fatalf("a second submit: %v", err)
	}
	waitStatus(t, e, "t2", api.TaskRunning)
	if _, err := e.Submit(api.TaskConfig{ID: "t3", Name: "n", ImageName: "img"}); !errors.Is(err, runnerdir.ErrNoRoom) {
		t.Fatalf("a third submit: %v", err)
	}
	for _, id := range []string{cfg.ID, "t2"} {
		if _, err := e.Terminate(context.Background(), id, api.TaskTerminateRequest{}); err != nil {
			t.Fatal(err)
		}
		waitStatus(t, e, id, api.TaskTerminated)
		if err := e.Remove(context.Background(), id); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := e.Submit(api.TaskConfig{ID: "t3", Name: "n", ImageName: "img"}); err != nil {
		t.Fatalf("a submit once the others are removed: %v", err)
	}
	waitStatus(t, e, "t3", api.TaskRunning)
	if _, err := e.Terminate(context.Background(), "t3", api.TaskTerminateRequest{}); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, e, "t3", api.TaskTerminated)
	if err := e.Remove(context.Background(), "t3"); err != nil {
		t.Fatal(err)
	}
}
