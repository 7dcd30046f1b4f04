package task

// The runner dir: a task's first kind (resource.go), <home>/runners/<container
// name>, a filesystem of its own where RunnerDirs bound it (shim/runnerdir).

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/tandem-run/tandem/api"
)

// runnerDir is <home>/runners/<container name>; a name that is not one path
// component (a damaged record) has no dir, never a parent's.
func (e *Engine) runnerDir(t *task) (string, error) {
	if t.name == "" || t.name != filepath.Base(t.name) || t.name == "." || t.name == ".." {
		return "", fmt.Errorf("task %s has no valid container name (%q)", t.cfg.ID, t.name)
	}
	return filepath.Join(e.cfg.Home, "runners", t.name), nil
}

// roomReserver is what RunnerDirs may also be: they take a new task's room
// on the disk before it is accepted (an error: refused, nothing written).
type roomReserver interface {
	Reserve(dir string) (release func(), err error)
}

// reserveRunnerDir takes the room of t's runner dir, when its RunnerDirs
// take room; release gives it back, harmless once the dir is made.
func (e *Engine) reserveRunnerDir(t *task) (release func(), err error) {
	r, ok := e.cfg.RunnerDirs.(roomReserver)
	if !ok {
		return func() {}, nil
	}
	dir, err := e.runnerDir(t)
	if err != nil {
		return func() {}, nil // the start fails on it, and says why
	}
	return r.Reserve(dir)
}

// runnerDirResource is the task's runner dir, <home>/runners/<container
// name>: made by the start (pipeline.go), kept after the task ends (the
// job's final state and log are read from it), re-attached after a
// restart, removed with the task.
type runnerDirResource struct{ e *Engine }

func (runnerDirResource) kind() string { return "runner_dir" }

// acquire makes the dir; its own filesystem is made and mounted in the
// background while the image is checked and the container created (2-3
// ms off every start). Nothing is written into the dir before it is ready
// (a pull's log waits), the container starts only then, and the start does
// not return before it is done, so release never races a mount.
func (r runnerDirResource) acquire(s *starting) *failure {
	dir, err := r.e.runnerDir(s.t)
	if err == nil {
		// The bind's source exists from here on: Docker checks it at
		// create, and binds what is mounted there at start.
		err = os.MkdirAll(dir, 0o755)
	}
	if err == nil {
		err = os.MkdirAll(r.e.hostFSProbe(), 0o555)
	}
	if err != nil {
		return failf(api.ReasonExecutorError, "prepare runner dir error: %v", err)
	}
	if h, ok := r.e.cfg.RunnerDirs.(startHolder); ok {
		// The next ready copy waits until this start is over.
		s.onReturn(h.Hold())
	}
	s.dir, s.dirReady = dir, r.e.makeRunnerDir(s.ctx, dir)
	s.onReturn(func() { _ = s.dirReady() })
	return nil
}

func (r runnerDirResource) restore(t *task, log *slog.Logger) {
	dir, err := r.e.runnerDir(t)
	if err != nil {
		return
	}
	// After a reboot its filesystem is no longer mounted: the job's final
	// state and log are in it.
	if err := r.e.cfg.RunnerDirs.Attach(dir); err != nil {
		log.Warn("runner dir not re-attached", "dir", dir, "err", err)
	}
}

func (r runnerDirResource) remove(_ context.Context, t *task) error {
	dir, err := r.e.runnerDir(t)
	if err != nil {
		return nil // a damaged record's task has no dir
	}
	if err := r.e.cfg.RunnerDirs.Remove(dir); err != nil {
		return fmt.Errorf("remove runner dir: %w", err)
	}
	return nil
}

// makeRunnerDir makes dir's filesystem in the background; the returned
// func waits for it and gives its error, the same each call.
func (e *Engine) makeRunnerDir(ctx context.Context, dir string) func() error {
	made := make(chan struct{})
	var err error
	go func() {
		defer close(made)
		err = e.cfg.RunnerDirs.Make(ctx, dir)
	}()
	return func() error {
		<-made
		return err
	}
}

// startHolder is what RunnerDirs may also be: their background work waits
// from Hold until release, while a task's start is under way.
type startHolder interface {
	Hold() (release func())
}
