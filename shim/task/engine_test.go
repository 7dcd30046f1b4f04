package task

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/shim/gpu"
)

// stepRuntime is a Runtime whose calls can be held at a step, to put the
// pipeline exactly where a race happens. Containers "run" until stopped.
type stepRuntime struct {
	mu      sync.Mutex
	hold    map[string]chan struct{} // step name → released when closed
	reached map[string]chan struct{}
	created map[string]bool // live containers by id
	names   map[string]string
	gpus    map[string][]string      // the GPUs a container's device request names
	specs   map[string]ContainerSpec // what each was created with: its labels and binds
	idle    map[string]bool          // created and never started (neverStarted)
	exit    map[string]*exitState
	n       int
}

// exitState is a test container's exit: done is closed once, code set
// before it, so any number of waiters see the same exit.
type exitState struct {
	once sync.Once
	done chan struct{}
	code int
}

func (x *exitState) stop(code int) {
	x.once.Do(func() { x.code = code; close(x.done) })
}

func newStepRuntime() *stepRuntime {
	return &stepRuntime{hold: map[string]chan struct{}{}, reached: map[string]chan struct{}{},
		created: map[string]bool{}, names: map[string]string{}, exit: map[string]*exitState{}, gpus: map[string][]string{}, idle: map[string]bool{}, specs: map[string]ContainerSpec{}}
}

// holdAt makes the next call of step block until the returned func is called.
func (r *stepRuntime) holdAt(step string) (reached <-chan struct{}, release func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	h, re := make(chan struct{}), make(chan struct{})
	r.hold[step], r.reached[step] = h, re
	var once sync.Once
	return re, func() { once.Do(func() { close(h) }) }
}

func (r *stepRuntime) step(ctx context.Context, name string) error {
	r.mu.Lock()
	h, re := r.hold[name], r.reached[name]
	delete(r.hold, name)
	r.mu.Unlock()
	if h == nil {
		return nil
	}
	close(re)
	select {
	case <-h:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (r *stepRuntime) ImagePresent(ctx context.Context, ref string) (bool, error) { return true, nil }
func (r *stepRuntime) Pull(ctx context.Context, ref string, _ RegistryAuth) (io.ReadCloser, error) {
	if err := r.step(ctx, "pull"); err != nil {
		return nil, err
	}
	return io.NopCloser(strings.NewReader("")), nil
}
func (r *stepRuntime) Create(ctx context.Context, s ContainerSpec) (string, error) {
	if err := r.step(ctx, "create"); err != nil {
		return "", err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.n++
	id := "c" + string(rune('0'+r.n))
	r.created[id], r.names[s.Name], r.exit[id], r.specs[id] = true, id, &exitState{done: make(chan struct{})}, s
	if s.GPUs != nil {
		r.gpus[id] = s.GPUs.DeviceIDs
	}
	return id, nil
}
func (r *stepRuntime) Start(ctx context.Context, id string) error { return r.step(ctx, "start") }
func (r *stepRuntime) Address(ctx context.Context, id, network string) (string, error) {
	return "127.0.0.1", nil
}
func (r *stepRuntime) Wait(ctx context.Context, id string) (int, error) {
	r.mu.Lock()
	x := r.exit[id]
	r.mu.Unlock()
	if x == nil {
		return -1, ErrContainerGone
	}
	<-x.done
	return x.code, nil
}

// Stop takes a name or an id, as Docker does.
func (r *stepRuntime) Stop(ctx context.Context, id string, _ time.Duration) error {
	if err := r.step(ctx, "stop"); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if byName, ok := r.names[id]; ok {
		id = byName
	}
	if x := r.exit[id]; x != nil {
		x.stop(137)
	}
	return nil
}

// Remove takes a name or an id, as Docker does.
func (r *stepRuntime) Remove(ctx context.Context, idOrName string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if id, ok := r.names[idOrName]; ok {
		delete(r.created, id)
		delete(r.names, idOrName)
		return nil
	}
	delete(r.created, idOrName)
	for name, id := range r.names {
		if id == idOrName {
			delete(r.names, name)
		}
	}
	return nil
}
func (r *stepRuntime) ImageConfig(ctx context.Context, id string) (api.TaskImageConfig, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.created[id] {
		return api.TaskImageConfig{}, ErrContainerGone
	}
	img := r.specs[id].Image
	return api.TaskImageConfig{Image: "sha256:" + img, Entrypoint: []string{}, Cmd: []string{"echo", img}, Env: []string{}}, nil
}
func (r *stepRuntime) LogTail(ctx context.Context, id string, n int) (string, error) { return "", nil }
func (r *stepRuntime) GPUMode(context.Context) (string, error)                       { return "hook", nil }

// running counts the containers that were started and have not exited.
func (r *stepRuntime) running() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for id := range r.created {
		if r.state(id).Running && !r.idle[id] {
			n++
		}
	}
	return n
}

func (r *stepRuntime) live() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.created)
}

func newEngine(t *testing.T, rt Runtime, gpus ...string) (*Engine, *gpu.Locks) {
	t.Helper()
	locks := gpu.NewLocks(gpus)
	runner := t.TempDir() + "/runner"
	_ = os.WriteFile(runner, nil, 0o755)
	e := New(Config{Home: t.TempDir(), RunnerBinary: runner, RunnerHTTPPort: 10999, RunnerSSHPort: 10022,
		RunnerLogLevel: "info", InfinibandPath: "/nonexistent/ib", TerminateWait: 5 * time.Second}, rt, locks, nil, logging.Discard())
	t.Cleanup(e.Sync) // record writes finish before the temp dirs go
	return e, locks
}

func waitStatus(t *testing.T, e *Engine, id string, want api.TaskStatus) api.TaskInfoResponse {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		if info, _ := e.Get(id); info.Status == want {
			return info
		}
		time.Sleep(2 * time.Millisecond)
	}
	info, _ := e.Get(id)
	t.Fatalf("task %s: want %s, have %+v", id, want, info)
	return info
}

func TestTerminateRacingCreateLeavesNoOrphan(t *testing.T) {
	rt := newStepRuntime()
	e, locks := newEngine(t, rt, "g0", "g1")
	reached, release := rt.holdAt("create")
	if _, err := e.Submit(api.TaskConfig{ID: "t1", Name: "n", ImageName: "img:1", GPU: 2}); err != nil {
		t.Fatal(err)
	}
	<-reached // the pipeline is inside Docker's create
	done := make(chan api.TaskInfoResponse)
	go func() {
		info, err := e.Terminate(context.Background(), "t1", api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser})
		if err != nil {
			t.Error(err)
		}
		done <- info
	}()
	time.Sleep(20 * time.Millisecond)
	release() // create completes after terminate was asked
	info := <-done
	if info.Status != api.TaskTerminated || info.TerminationReason != api.ReasonTerminatedByUser {
		t.Fatalf("%+v", info)
	}
	if locks.Free() != 2 {
		t.Fatal("GPUs must be free once terminate returns")
	}
	if rt.live() != 1 {
		t.Fatalf("the created container must be known to the task, live=%d", rt.live())
	}
	if err := e.Remove(context.Background(), "t1"); err != nil {
		t.Fatal(err)
	}
	if rt.live() != 0 {
		t.Fatal("remove must delete the container created during terminate")
	}
}

func TestTerminateDuringPullAndStart(t *testing.T) {
	for _, step := range []string{"pull", "start"} {
		t.Run(step, func(t *testing.T) {
			rt := newStepRuntime()
			e, _ := newEngine(t, rt)
			reached, release := rt.holdAt(step)
			defer release()
			if _, err := e.Submit(api.TaskConfig{ID: "t", Name: "n", ImageName: "img"}); err != nil {
				t.Fatal(err)
			}
			<-reached
			go func() { time.Sleep(20 * time.Millisecond); release() }()
			info, err := e.Terminate(context.Background(), "t", api.TaskTerminateRequest{})
			if err != nil {
				t.Fatal(err)
			}
			// Empty reason from the server's dangling-task cleanup: still an enum value.
			if info.Status != api.TaskTerminated || !info.TerminationReason.Valid() {
				t.Fatalf("%+v", info)
			}
			e.Wait()
			if got, _ := e.Get("t"); got.Status != api.TaskTerminated {
				t.Fatalf("a started container must not be left running: %+v", got)
			}
		})
	}
}

// A caller that gives up on a terminate (dstack's server: 9 s) gets its
// context's error at once, and the stop it asked for still runs to its
// end: Docker's stop is not cancelled half way, and the next call (and
// Remove) find the task terminated.
func TestTerminateOutlivesItsCaller(t *testing.T) {
	rt := newStepRuntime()
	e, _ := newEngine(t, rt)
	if _, err := e.Submit(api.TaskConfig{ID: "t", Name: "n", ImageName: "img"}); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, e, "t", api.TaskRunning)
	reached, release := rt.holdAt("stop")
	defer release()
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := e.Terminate(ctx, "t", api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser, TerminationMessage: "bye"})
		errc <- err
	}()
	<-reached // Docker's stop is under way
	cancel()  // and the caller leaves
	select {
	case err := <-errc:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("the caller that left: %v, want its context's error", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Terminate kept a caller that left waiting for the stop")
	}
	if info, _ := e.Get("t"); info.Status == api.TaskTerminated {
		t.Fatalf("terminated before Docker's stop returned: %+v", info)
	}
	// Calls that come meanwhile wait for the stop, but only as long as
	// their own callers do.
	short, cancelShort := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancelShort()
	if err := e.Remove(short, "t"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("remove while the stop runs: %v, want its deadline", err)
	}
	if _, err := e.Terminate(short, "t", api.TaskTerminateRequest{}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("terminate while the stop runs: %v, want its deadline", err)
	}
	// Docker's stop returns: with nobody asking again, the task ends (a
	// stop tied to the caller would have seen a cancelled context and left
	// the container running).
	release()
	info := waitStatus(t, e, "t", api.TaskTerminated)
	if info.TerminationReason != api.ReasonTerminatedByUser || info.TerminationMessage != "bye" {
		t.Fatalf("after the stop ran on: %+v, want the caller's reason", info)
	}
	again, err := e.Terminate(context.Background(), "t", api.TaskTerminateRequest{TerminationReason: api.ReasonContainerExitedWithError})
	if err != nil || again.TerminationReason != api.ReasonTerminatedByUser {
		t.Fatalf("terminate again: %+v, %v", again, err)
	}
	if err := e.Remove(context.Background(), "t"); err != nil {
		t.Fatal(err)
	}
	e.Wait()
}

func TestGPUReleasedExactlyOnce(t *testing.T) {
	rt := newStepRuntime()
	e, locks := newEngine(t, rt, "g0")
	if _, err := e.Submit(api.TaskConfig{ID: "a", Name: "a", ImageName: "img", GPU: 1}); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, e, "a", api.TaskRunning)
	if _, err := e.Submit(api.TaskConfig{ID: "b", Name: "b", ImageName: "img", GPU: 1}); err != nil {
		t.Fatal(err)
	}
	info := waitStatus(t, e, "b", api.TaskTerminated)
	if info.TerminationReason != api.ReasonExecutorError || info.TerminationMessage != "no capacity: 1 GPUs requested, 0 available" {
		t.Fatalf("%+v", info)
	}
	if _, err := e.Terminate(context.Background(), "a", api.TaskTerminateRequest{}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Submit(api.TaskConfig{ID: "c", Name: "c", ImageName: "img", GPU: 1}); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, e, "c", api.TaskRunning)
	// Terminating "a" again (and removing it) must not free c's GPU.
	_, _ = e.Terminate(context.Background(), "a", api.TaskTerminateRequest{})
	_ = e.Remove(context.Background(), "a")
	if locks.Free() != 0 {
		t.Fatal("a stale release freed a GPU held by another task")
	}
}

func TestRunnerDirFailureEndsTask(t *testing.T) {
	rt := newStepRuntime()
	e, _ := newEngine(t, rt)
	// Home is a file: the runner dir cannot be created.
	f := t.TempDir() + "/file"
	_ = os.WriteFile(f, nil, 0o644)
	e.cfg.Home = f
	if _, err := e.Submit(api.TaskConfig{ID: "t", Name: "n", ImageName: "img"}); err != nil {
		t.Fatal(err)
	}
	info := waitStatus(t, e, "t", api.TaskTerminated)
	if info.TerminationReason != api.ReasonExecutorError || !strings.Contains(info.TerminationMessage, "runner dir") {
		t.Fatalf("must not stay in preparing: %+v", info)
	}
}

func TestInstanceMountRules(t *testing.T) {
	rt := newStepRuntime()
	e, _ := newEngine(t, rt)
	for _, tc := range []struct {
		m    api.InstanceMountPoint
		want string
	}{
		{api.InstanceMountPoint{InstancePath: "rel/path", Path: "/x"}, "paths must be absolute"},
		{api.InstanceMountPoint{InstancePath: e.cfg.Home + "/runners", Path: "/x"}, "under the shim home"},
	} {
		id := "t" + tc.want[:3]
		if _, err := e.Submit(api.TaskConfig{ID: id, Name: "n", ImageName: "img", InstanceMounts: []api.InstanceMountPoint{tc.m}}); err != nil {
			t.Fatal(err)
		}
		info := waitStatus(t, e, id, api.TaskTerminated)
		if info.TerminationReason != api.ReasonExecutorError || !strings.Contains(info.TerminationMessage, tc.want) {
			t.Fatalf("%+v: %+v", tc.m, info)
		}
	}
}

func TestImageRef(t *testing.T) {
	for _, tc := range []struct {
		in, ref string
		reuse   bool
	}{
		{"ubuntu", "ubuntu:latest", false},
		{"ubuntu:22.04", "ubuntu:22.04", true},
		{"ubuntu:latest", "ubuntu:latest", false},
		{"host:5000/img", "host:5000/img:latest", false},
		{"host:5000/img:v1", "host:5000/img:v1", true},
		{"busybox@sha256:" + strings.Repeat("a", 64), "busybox@sha256:" + strings.Repeat("a", 64), true},
	} {
		ref, reuse, err := imageRef(tc.in)
		if err != nil || ref != tc.ref || reuse != tc.reuse {
			t.Errorf("imageRef(%q) = %q %v %v", tc.in, ref, reuse, err)
		}
	}
	if _, _, err := imageRef("UPPER/Case"); err == nil {
		t.Error("invalid references must be rejected")
	}
}

func TestSubmitErrorsAreClassified(t *testing.T) {
	e, _ := newEngine(t, newStepRuntime())
	if _, err := e.Submit(api.TaskConfig{ID: "x", Name: "a b", ImageName: "i"}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("bad name: %v", err)
	}
	for _, img := range []string{"ubuntu\x1b]0;pwned\x07", "a\nb", "UPPER/Case", "img:tag:tag", " img", strings.Repeat("a", 300)} {
		_, err := e.Submit(api.TaskConfig{ID: "x", Name: "n", ImageName: img})
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "not a valid image reference") {
			t.Errorf("image %q: %v", img, err)
		}
		if strings.ContainsAny(fmt.Sprint(err), "\x1b\n\x07") {
			t.Errorf("image %q: the message carries control characters: %q", img, err)
		}
	}
	if len(e.List()) != 0 {
		t.Fatalf("refused submits left tasks: %v", e.List())
	}
	for _, img := range []string{"ubuntu", "ubuntu:22.04", "dstackai/base:py3.12-0.7-cuda-12.1", "nvcr.io/nvidia/pytorch:24.01-py3",
		"localhost:5000/a/b@sha256:" + strings.Repeat("a", 64)} {
		if err := validate(api.TaskConfig{ID: "x", Name: "n", ImageName: img}); err != nil {
			t.Errorf("image %q refused: %v", img, err)
		}
	}
	if _, err := e.Get("nope"); !errors.Is(err, ErrNotFound) {
		t.Fatal(err)
	}
	if err := e.Remove(context.Background(), "nope"); !errors.Is(err, ErrNotFound) {
		t.Fatal(err)
	}
}

// neverStarted marks a container as created and never started.
func (r *stepRuntime) neverStarted(id string) {
	r.mu.Lock()
	r.idle[id] = true
	r.mu.Unlock()
}

func (r *stepRuntime) state(id string) ContainerState {
	st := ContainerState{ID: id, Name: r.nameOf(id), NeverStarted: true, Ports: []api.PortMapping{}}
	if !r.idle[id] {
		st = ContainerState{ID: id, Name: r.nameOf(id), Running: true, Ports: []api.PortMapping{}, GPUIDs: r.gpus[id]}
		select {
		case <-r.exit[id].done:
			st.Running, st.ExitCode = false, r.exit[id].code
		default:
		}
	}
	// Labels and the runner dir as Docker shows them (whose it is).
	s := r.specs[id]
	st.TaskID, st.ShimHome = s.Labels[LabelTaskID], s.Labels[LabelShimHome]
	for _, b := range s.Binds {
		if b.Target == RunnerDirInContainer {
			st.RunnerDir = b.Source
		}
	}
	if st.Running { // Docker's bindings, while it runs: the runner's too
		for _, p := range s.ExposedTCP {
			st.Published = append(st.Published, api.PublishedPort{HostIP: "0.0.0.0", HostPort: 40000 + p%1000, ContainerPort: p, Protocol: "tcp"})
		}
		for i, p := range s.Published {
			hp := cmp.Or(p.HostPort, 49152+i)
			st.Published = append(st.Published, api.PublishedPort{HostIP: cmp.Or(p.HostIP, "0.0.0.0"), HostPort: hp, ContainerPort: p.ContainerPort, Protocol: cmp.Or(p.Protocol, "tcp")})
		}
	}
	return st
}

func (r *stepRuntime) nameOf(id string) string {
	for name, cid := range r.names {
		if cid == id {
			return name
		}
	}
	return ""
}

func (r *stepRuntime) Containers(context.Context) ([]ContainerState, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []ContainerState
	for id := range r.created {
		out = append(out, r.state(id))
	}
	return out, nil
}

// Inspect takes a name or an id, as Docker does.
func (r *stepRuntime) Inspect(_ context.Context, id string) (ContainerState, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if byName, ok := r.names[id]; ok {
		id = byName
	}
	if !r.created[id] {
		return ContainerState{}, ErrContainerGone
	}
	return r.state(id), nil
}

// TestPublishedPortsReported: a running task's answer has its job's
// published ports as Docker bound them (the host port Docker picked for
// a 0), never the runner's, and none once it ended.
func TestPublishedPortsReported(t *testing.T) {
	rt := newStepRuntime()
	e, _ := newEngine(t, rt)
	cfg := api.TaskConfig{ID: "pp", Name: "pp", ImageName: "i", NetworkMode: "bridge",
		Publish: []api.PublishedPort{{ContainerPort: 80}, {HostIP: "127.0.0.1", HostPort: 5353, ContainerPort: 53, Protocol: "udp"}}}
	if _, err := e.Submit(cfg); err != nil {
		t.Fatal(err)
	}
	info := waitStatus(t, e, "pp", api.TaskRunning)
	want := []api.PublishedPort{{HostIP: "0.0.0.0", HostPort: 49152, ContainerPort: 80, Protocol: "tcp"}, {HostIP: "127.0.0.1", HostPort: 5353, ContainerPort: 53, Protocol: "udp"}}
	if info.Tandem == nil || !reflect.DeepEqual(info.Tandem.Published, want) {
		t.Fatalf("published: %+v, want %+v", info.Tandem, want)
	}
	if _, err := e.Terminate(context.Background(), "pp", api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser}); err != nil {
		t.Fatal(err)
	}
	if info := waitStatus(t, e, "pp", api.TaskTerminated); info.Tandem.Published != nil {
		t.Fatalf("an ended task still shows ports: %+v", info.Tandem.Published)
	}
}

// TestSubmitPublish: tandem_publish is taken on the bridge network only,
// with ports in range, tcp or udp, an IP address, never the runner's
// ports; a refusal leaves no task.
func TestSubmitPublish(t *testing.T) {
	e, _ := newEngine(t, newStepRuntime())
	runnerHTTP := e.runnerPorts()[0]
	for _, tc := range []struct {
		network string
		pub     api.PublishedPort
		want    string
	}{
		{"host", api.PublishedPort{ContainerPort: 80}, "tandem_publish needs network_mode bridge"},
		{"", api.PublishedPort{ContainerPort: 80}, "tandem_publish needs network_mode bridge"},
		{"bridge", api.PublishedPort{ContainerPort: 0}, "container_port 0 is not a port"},
		{"bridge", api.PublishedPort{ContainerPort: 80, HostPort: 70000}, "host_port 70000 is not a port"},
		{"bridge", api.PublishedPort{ContainerPort: 80, Protocol: "sctp\x1b[2J"}, `protocol "sctp\\x1b[2J": want tcp or udp`},
		{"bridge", api.PublishedPort{ContainerPort: 80, HostIP: "localhost"}, `host_ip "localhost" is not an IP address`},
		{"bridge", api.PublishedPort{ContainerPort: runnerHTTP}, "is the runner's (its API and SSH server), never published"},
	} {
		_, err := e.Submit(api.TaskConfig{ID: "p1", Name: "p", ImageName: "i", NetworkMode: tc.network, Publish: []api.PublishedPort{tc.pub}})
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s %+v: %v, want %q", tc.network, tc.pub, err, tc.want)
		}
	}
	many := make([]api.PublishedPort, MaxPublished+1)
	for i := range many {
		many[i] = api.PublishedPort{ContainerPort: 20000 + i}
	}
	if _, err := e.Submit(api.TaskConfig{ID: "p1", Name: "p", ImageName: "i", NetworkMode: "bridge", Publish: many}); !errors.Is(err, ErrInvalid) {
		t.Errorf("%d ports: %v", len(many), err)
	}
	if len(e.List()) != 0 {
		t.Fatalf("refused submits left tasks: %v", e.List())
	}
	ok := api.TaskConfig{ID: "p2", Name: "p", ImageName: "i", NetworkMode: "bridge",
		Publish: []api.PublishedPort{{ContainerPort: 80, HostPort: 8080, HostIP: "127.0.0.1"}, {ContainerPort: 53, Protocol: "udp"}}}
	if err := validatePublish(ok, e.runnerPorts()); err != nil {
		t.Fatalf("a good publish refused: %v", err)
	}
}
