package task

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/shim/runnerdir"
)

// gatedDirs are runner dirs whose Make waits for release, then fails with
// err (nil: succeeds).
type gatedDirs struct {
	entered chan struct{}
	release chan struct{}
	err     error
	mu      sync.Mutex
	made    bool
	holds   int // Hold minus release
	held    int // Hold calls
}

func (g *gatedDirs) Hold() func() {
	g.mu.Lock()
	g.holds++
	g.held++
	g.mu.Unlock()
	var once sync.Once
	return func() { once.Do(func() { g.mu.Lock(); g.holds--; g.mu.Unlock() }) }
}

func (g *gatedDirs) holding() (now, ever int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.holds, g.held
}

func newGatedDirs(err error) *gatedDirs {
	return &gatedDirs{entered: make(chan struct{}), release: make(chan struct{}), err: err}
}

func (g *gatedDirs) Make(_ context.Context, dir string) error {
	close(g.entered)
	<-g.release
	g.mu.Lock()
	defer g.mu.Unlock()
	g.made = g.err == nil
	if g.err != nil {
		return g.err
	}
	return os.MkdirAll(dir, 0o755)
}
func (g *gatedDirs) Attach(string) error     { return nil }
func (g *gatedDirs) Remove(dir string) error { return os.RemoveAll(dir) }
func (g *gatedDirs) isMade() bool            { g.mu.Lock(); defer g.mu.Unlock(); return g.made }

func gatedEngine(t *testing.T, rt Runtime, dirs RunnerDirs) *Engine {
	t.Helper()
	runner := t.TempDir() + "/runner"
	_ = os.WriteFile(runner, nil, 0o755)
	e := New(Config{Home: t.TempDir(), RunnerBinary: runner, RunnerHTTPPort: 10999, RunnerSSHPort: 10022,
		RunnerLogLevel: "info", InfinibandPath: "/nonexistent/ib", TerminateWait: 5 * time.Second, RunnerDirs: dirs},
		rt, nil, nil, logging.Discard())
	t.Cleanup(e.Sync)
	return e
}

// The runner dir's filesystem is made while the container is created,
// and the container starts only once it is there.
func TestRunnerDirIsMadeBesideCreateAndBeforeStart(t *testing.T) {
	rt := newStepRuntime()
	dirs := newGatedDirs(nil)
	e := gatedEngine(t, rt, dirs)
	created, releaseCreate := rt.holdAt("create")
	started, releaseStart := rt.holdAt("start")
	defer releaseStart()
	if _, err := e.Submit(api.TaskConfig{ID: "t", Name: "n", ImageName: "img:1"}); err != nil {
		t.Fatal(err)
	}
	<-dirs.entered
	select {
	case <-created: // Docker's create is called while the dir is still being made
	case <-time.After(5 * time.Second):
		t.Fatal("create waited for the runner dir")
	}
	releaseCreate()
	select {
	case <-started:
		t.Fatal("the container started before its runner dir was made")
	case <-time.After(100 * time.Millisecond):
	}
	close(dirs.release)
	<-started
	if !dirs.isMade() {
		t.Fatal("start reached before Make returned")
	}
	releaseStart()
	waitStatus(t, e, "t", api.TaskRunning)
}

// The dirs' background work (the next ready copy) is held from before the
// dir is taken until the container's start has returned, and released
// once, however the start ends.
func TestStartHoldsTheDirsBackgroundWork(t *testing.T) {
	rt := newStepRuntime()
	dirs := newGatedDirs(nil)
	e := gatedEngine(t, rt, dirs)
	started, releaseStart := rt.holdAt("start")
	defer releaseStart()
	if _, err := e.Submit(api.TaskConfig{ID: "t", Name: "n", ImageName: "img:1"}); err != nil {
		t.Fatal(err)
	}
	<-dirs.entered
	if now, _ := dirs.holding(); now != 1 {
		t.Fatalf("Make ran with %d holds, want 1", now)
	}
	close(dirs.release)
	<-started
	if now, _ := dirs.holding(); now != 1 {
		t.Fatalf("Docker's start ran with %d holds, want 1", now)
	}
	releaseStart()
	waitStatus(t, e, "t", api.TaskRunning)
	for i := 0; ; i++ { // released as the pipeline returns, right after running
		now, ever := dirs.holding()
		if now == 0 && ever == 1 {
			break
		}
		if i > 500 {
			t.Fatalf("after running: %d holds left of %d", now, ever)
		}
		time.Sleep(10 * time.Millisecond)
	}

	// A start that fails releases too.
	failing := newGatedDirs(errors.New("no loop device"))
	close(failing.release)
	e2 := gatedEngine(t, newStepRuntime(), failing)
	if _, err := e2.Submit(api.TaskConfig{ID: "t2", Name: "n2", ImageName: "img:1"}); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, e2, "t2", api.TaskTerminated)
	if now, ever := failing.holding(); now != 0 || ever != 1 {
		t.Fatalf("after a failed start: %d holds left of %d", now, ever)
	}
}

// A dir that cannot be made ends the task as an executor error, and its
// created container never starts.
func TestRunnerDirFailureEndsTheTaskUnstarted(t *testing.T) {
	rt := newStepRuntime()
	dirs := newGatedDirs(errors.New("no loop device"))
	close(dirs.release)
	e := gatedEngine(t, rt, dirs)
	started, releaseStart := rt.holdAt("start")
	defer releaseStart()
	if _, err := e.Submit(api.TaskConfig{ID: "t", Name: "n", ImageName: "img:1"}); err != nil {
		t.Fatal(err)
	}
	info := waitStatus(t, e, "t", api.TaskTerminated)
	if info.TerminationReason != api.ReasonExecutorError || !strings.Contains(info.TerminationMessage, "prepare runner dir error: no loop device") {
		t.Fatalf("%+v", info)
	}
	select {
	case <-started:
		t.Fatal("the container started without its runner dir")
	default:
	}
}

// A terminate while the dir is being made waits for it: the task ends
// only after Make returned, so release never races a mount.
func TestTerminateWhileTheRunnerDirIsMade(t *testing.T) {
	rt := newStepRuntime()
	dirs := newGatedDirs(nil)
	e := gatedEngine(t, rt, dirs)
	created, releaseCreate := rt.holdAt("create")
	if _, err := e.Submit(api.TaskConfig{ID: "t", Name: "n", ImageName: "img:1"}); err != nil {
		t.Fatal(err)
	}
	<-dirs.entered
	<-created
	done := make(chan api.TaskInfoResponse, 1)
	go func() {
		info, err := e.Terminate(context.Background(), "t", api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser})
		if err != nil {
			t.Error(err)
		}
		done <- info
	}()
	releaseCreate()
	select {
	case info := <-done:
		t.Fatalf("terminated while the dir was still being made: %+v", info)
	case <-time.After(100 * time.Millisecond):
	}
	close(dirs.release)
	info := <-done
	if info.Status != api.TaskTerminated || info.TerminationReason != api.ReasonTerminatedByUser {
		t.Fatalf("%+v", info)
	}
}

// storeRuntime is a stepRuntime with an image store: create refuses an
// image that is not there, as Docker does, until a pull brings it.
type storeRuntime struct {
	*stepRuntime
	mu                       sync.Mutex
	present                  map[string]bool
	inspects, pulls, creates int
}

func (s *storeRuntime) ImagePresent(_ context.Context, ref string) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.inspects++
	return s.present[ref], nil
}

func (s *storeRuntime) Pull(ctx context.Context, ref string, auth RegistryAuth) (io.ReadCloser, error) {
	s.mu.Lock()
	s.pulls++
	s.present[ref] = true
	s.mu.Unlock()
	return s.stepRuntime.Pull(ctx, ref, auth)
}

func (s *storeRuntime) Create(ctx context.Context, spec ContainerSpec) (string, error) {
	s.mu.Lock()
	s.creates++
	ref, _, _ := imageRef(spec.Image) // img is img:latest, as in Docker
	ok := s.present[ref]
	s.mu.Unlock()
	if !ok {
		return "", fmt.Errorf("create container %s: %w: No such image: %s", spec.Name, ErrNoImage, spec.Image)
	}
	return s.stepRuntime.Create(ctx, spec)
}

func (s *storeRuntime) counts() (int, int, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.inspects, s.pulls, s.creates
}

// A tagged image is created from as it is: no inspect before create, no
// pull when it is there; when it is not, create's refusal brings one pull
// and a second create.
func TestLocalImageIsUsedWithoutACheckAndPulledWhenMissing(t *testing.T) {
	rt := &storeRuntime{stepRuntime: newStepRuntime(), present: map[string]bool{"img:1": true}}
	e, _ := newEngine(t, rt)
	if _, err := e.Submit(api.TaskConfig{ID: "here", Name: "here", ImageName: "img:1"}); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, e, "here", api.TaskRunning)
	if inspects, pulls, creates := rt.counts(); inspects != 0 || pulls != 0 || creates != 1 {
		t.Fatalf("a present image: %d inspects, %d pulls, %d creates; want 0, 0, 1", inspects, pulls, creates)
	}
	if _, err := e.Submit(api.TaskConfig{ID: "missing", Name: "missing", ImageName: "other:2"}); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, e, "missing", api.TaskRunning)
	// The pull checks that the image landed (one inspect).
	if inspects, pulls, creates := rt.counts(); inspects != 1 || pulls != 1 || creates != 3 {
		t.Fatalf("a missing image: %d inspects, %d pulls, %d creates in all; want 1, 1, 3", inspects, pulls, creates)
	}
	// latest is pulled before create, every time.
	if _, err := e.Submit(api.TaskConfig{ID: "latest", Name: "latest", ImageName: "img"}); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, e, "latest", api.TaskRunning)
	if _, pulls, creates := rt.counts(); pulls != 2 || creates != 4 {
		t.Fatalf("latest: %d pulls, %d creates in all; want 2, 4", pulls, creates)
	}
}

// downRuntime is Docker unreachable at create (or cut off mid-create,
// when the error does not say nothing was made), and at remove (its
// inspect of whose the container under the name is, and its remove).
type downRuntime struct {
	*stepRuntime
	createErr error
	mu        sync.Mutex
	removes   int // Docker calls of a remove
}

func (d *downRuntime) Inspect(context.Context, string) (ContainerState, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.removes++
	return ContainerState{}, errors.New("Cannot connect to the Docker daemon")
}

func (d *downRuntime) Create(context.Context, ContainerSpec) (string, error) { return "", d.createErr }

func (d *downRuntime) Remove(context.Context, string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.removes++
	return errors.New("Cannot connect to the Docker daemon")
}

// A create that surely made nothing leaves remove nothing to ask Docker;
// one that may have made a container (a timeout) has remove look for it.
func TestRemoveAfterAFailedCreate(t *testing.T) {
	for _, c := range []struct {
		name      string
		err       error
		removeErr bool
	}{
		{"unreachable", fmt.Errorf("create container n: Cannot connect to the Docker daemon: %w", ErrNothingCreated), false},
		{"timed out", errors.New("create container n: context deadline exceeded"), true},
	} {
		t.Run(c.name, func(t *testing.T) {
			rt := &downRuntime{stepRuntime: newStepRuntime(), createErr: c.err}
			e := gatedEngine(t, rt, &runnerdir.Dirs{})
			if _, err := e.Submit(api.TaskConfig{ID: "t", Name: "n", ImageName: "img:1"}); err != nil {
				t.Fatal(err)
			}
			info := waitStatus(t, e, "t", api.TaskTerminated)
			if info.TerminationReason != api.ReasonCreatingContainerError {
				t.Fatalf("%+v", info)
			}
			err := e.Remove(context.Background(), "t")
			rt.mu.Lock()
			removes := rt.removes
			rt.mu.Unlock()
			if c.removeErr != (err != nil) || c.removeErr != (removes > 0) {
				t.Fatalf("remove: %v after %d Docker removes", err, removes)
			}
		})
	}
}

// earlyExitRuntime's containers stop before the shim reads their address
// (a bridge job that ends at once takes its address with it), unless
// running is set: then only the address lookup fails.
type earlyExitRuntime struct {
	*stepRuntime
	code    int
	running bool
	gone    bool // removed by someone else as well
	tail    string
}

func (r *earlyExitRuntime) Address(_ context.Context, id, _ string) (string, error) {
	if !r.running {
		r.mu.Lock()
		x := r.exit[id]
		if r.gone {
			delete(r.created, id)
		}
		r.mu.Unlock()
		x.stop(r.code)
	}
	return "", fmt.Errorf("container %s has no IPv4 address", id)
}

func (r *earlyExitRuntime) LogTail(context.Context, string, int) (string, error) {
	return r.tail, nil
}

// A bridge job that ends before its ports are forwarded ends as any job
// whose container stopped (done, or failed with its own last lines), not
// as a container that could not be created; while the container still
// runs, a failed forward stops it and says so.
func TestJobEndedBeforeItsPortsWereForwarded(t *testing.T) {
	for _, tc := range []struct {
		name    string
		rt      *earlyExitRuntime
		reason  api.TerminationReason
		message string
	}{
		{"failed", &earlyExitRuntime{code: 3, tail: "failed on purpose"}, api.ReasonContainerExitedWithError, "failed on purpose"},
		{"done", &earlyExitRuntime{code: 0, tail: "bye"}, api.ReasonDoneByRunner, ""},
		{"gone", &earlyExitRuntime{code: 3, gone: true}, api.ReasonContainerExitedWithError, "the container disappeared"},
		{"still running", &earlyExitRuntime{running: true}, api.ReasonCreatingContainerError, "forward the runner's ports: container c1 has no IPv4 address"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.rt.stepRuntime = newStepRuntime()
			e, _ := newEngine(t, tc.rt)
			e.cfg.Forwarder = nopForwarder{}
			if _, err := e.Submit(api.TaskConfig{ID: "br", Name: "br", ImageName: "img", NetworkMode: "bridge"}); err != nil {
				t.Fatal(err)
			}
			info := waitStatus(t, e, "br", api.TaskTerminated)
			if info.TerminationReason != tc.reason || info.TerminationMessage != tc.message {
				t.Fatalf("ended %s %q, want %s %q", info.TerminationReason, info.TerminationMessage, tc.reason, tc.message)
			}
			if n := tc.rt.stepRuntime.running(); n != 0 {
				t.Fatalf("%d containers still run", n)
			}
		})
	}
}

// The pull's log is never written through a link in the runner dir (the
// job's too): a link there fails the start and leaves its target as it was.
func TestPullLogNeverFollowsALink(t *testing.T) {
	rt := newStepRuntime()
	e, _ := newEngine(t, rt)
	target := filepath.Join(t.TempDir(), "host-file")
	if err := os.WriteFile(target, []byte("precious"), 0o644); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(e.cfg.Home, "runners", ContainerName("pl", "pl"))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, filepath.Join(dir, "pull.log")); err != nil {
		t.Fatal(err)
	}
	// :latest is always pulled.
	if _, err := e.Submit(api.TaskConfig{ID: "pl", Name: "pl", ImageName: "img:latest"}); err != nil {
		t.Fatal(err)
	}
	info := waitStatus(t, e, "pl", api.TaskTerminated)
	if !strings.Contains(info.TerminationMessage, "pull log") {
		t.Fatalf("ended %s %q", info.TerminationReason, info.TerminationMessage)
	}
	if b, _ := os.ReadFile(target); string(b) != "precious" {
		t.Fatalf("the link's target was written: %q", b)
	}
}
