package task

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/shim/gpu"
)

// A second engine on the same home and runtime plays the restarted shim.
func TestRestoreRelocksGPUsAndNeverDoubleAllocates(t *testing.T) {
	rt := newStepRuntime()
	e1, _ := newEngine(t, rt, "g0", "g1")
	if _, err := e1.Submit(api.TaskConfig{ID: "a", Name: "a", ImageName: "img", GPU: 1}); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, e1, "a", api.TaskRunning)
	e1.Sync() // the restarted shim reads what reached the disk

	locks := gpu.NewLocks([]string{"g0", "g1"})
	e2 := New(e1.cfg, rt, locks, nil, logging.Discard())
	t.Cleanup(e2.Sync)
	if err := e2.Restore(context.Background()); err != nil {
		t.Fatal(err)
	}
	info, err := e2.Get("a")
	if err != nil || info.Status != api.TaskRunning || len(info.GPUIDs) != 1 || info.GPUIDs[0] != "g0" {
		t.Fatalf("restored: %+v %v", info, err)
	}
	if locks.Free() != 1 {
		t.Fatalf("the restored task's GPU must be locked again: free=%d", locks.Free())
	}
	if _, err := e2.Submit(api.TaskConfig{ID: "b", Name: "b", ImageName: "img", GPU: 2}); err != nil {
		t.Fatal(err)
	}
	if b := waitStatus(t, e2, "b", api.TaskTerminated); b.TerminationReason != api.ReasonExecutorError {
		t.Fatalf("b must not get a's GPU: %+v", b)
	}
	// a's exit after the restart releases its GPU exactly once.
	if _, err := e2.Terminate(context.Background(), "a", api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser}); err != nil {
		t.Fatal(err)
	}
	if locks.Free() != 2 {
		t.Fatalf("free after a ended: %d", locks.Free())
	}
	// Reconcile twice more: idempotent, nothing re-locked or re-released.
	_ = e2.Reconcile(context.Background())
	_ = e2.Reconcile(context.Background())
	if locks.Free() != 2 {
		t.Fatalf("reconcile changed locks: %d", locks.Free())
	}
	if _, err := os.Stat(filepath.Join(e1.cfg.Home, "tasks", "a.json")); err != nil {
		t.Fatalf("record: %v", err)
	}
}

// A shim that dies while a terminate's stop runs (the stop asked, the
// container still up) finishes that stop once restarted, with the first
// call's reason: nobody has to ask again.
func TestRestartResumesAStopUnderWay(t *testing.T) {
	rt := newStepRuntime()
	e1, _ := newEngine(t, rt)
	if _, err := e1.Submit(api.TaskConfig{ID: "a", Name: "a", ImageName: "img"}); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, e1, "a", api.TaskRunning)
	reached, release := rt.holdAt("stop")
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		_, _ = e1.Terminate(ctx, "a", api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser, TerminationMessage: "asked before"})
	}()
	<-reached
	cancel()
	e1.Shutdown() // the shim dies: its stop's context ends with it
	e1.stops.Wait()
	e1.Sync()
	release()
	if info, _ := e1.Get("a"); info.Status != api.TaskRunning {
		t.Fatalf("the stop ran although the shim died: %+v", info)
	}

	e2 := New(e1.cfg, rt, gpu.NewLocks(nil), nil, logging.Discard())
	t.Cleanup(e2.Sync)
	if err := e2.Restore(context.Background()); err != nil {
		t.Fatal(err)
	}
	info := waitStatus(t, e2, "a", api.TaskTerminated)
	if info.TerminationReason != api.ReasonTerminatedByUser || info.TerminationMessage != "asked before" {
		t.Fatalf("after the restart: %+v", info)
	}
	if rt.running() != 0 {
		t.Fatal("the task's container still runs")
	}
	e2.Shutdown()
	e2.stops.Wait()
}

// TestResubmitWithRegistryAuthAfterRestart: the record keeps only a salted
// hash of the registry password; the server's identical re-submit after a
// restart is still idempotent, a different password still conflicts, and
// the password itself is nowhere on disk.
func TestResubmitWithRegistryAuthAfterRestart(t *testing.T) {
	rt := newStepRuntime()
	e1, _ := newEngine(t, rt)
	cfg := api.TaskConfig{ID: "p", Name: "p", ImageName: "img", RegistryUsername: "u", RegistryPassword: "s3cret-pass"}
	if _, err := e1.Submit(cfg); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, e1, "p", api.TaskRunning)
	e1.Sync()
	b, err := os.ReadFile(filepath.Join(e1.cfg.Home, "tasks", "p.json"))
	if err != nil || strings.Contains(string(b), "s3cret-pass") || !strings.Contains(string(b), "registry_password_hash") {
		t.Fatalf("record: %s %v", b, err)
	}
	e2 := New(e1.cfg, rt, gpu.NewLocks(nil), nil, logging.Discard())
	t.Cleanup(e2.Sync)
	if err := e2.Restore(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := e2.Submit(cfg); err != nil {
		t.Fatalf("identical re-submit after restart: %v", err)
	}
	other := cfg
	other.RegistryPassword = "another"
	if _, err := e2.Submit(other); !errors.Is(err, ErrConflict) {
		t.Fatalf("different password: %v", err)
	}
	e2.Sync()
	b, _ = os.ReadFile(filepath.Join(e1.cfg.Home, "tasks", "p.json"))
	if !strings.Contains(string(b), "registry_password_hash") {
		t.Fatal("a rewrite after restore lost the hash")
	}
}

// refRuntime lists cheaply (ContainerRefs) and counts inspects; taskOf
// labels containers with a task id (strays), homeOf with a shim home,
// dirOf binds a runner dir (over what they were created with).
type refRuntime struct {
	*stepRuntime
	mu       sync.Mutex
	taskOf   map[string]string
	homeOf   map[string]string
	dirOf    map[string]string
	inspects int
}

func newRefRuntime() *refRuntime {
	return &refRuntime{stepRuntime: newStepRuntime(), taskOf: map[string]string{}, homeOf: map[string]string{}, dirOf: map[string]string{}}
}

func (r *refRuntime) ContainerRefs(context.Context) ([]ContainerRef, error) {
	r.stepRuntime.mu.Lock()
	defer r.stepRuntime.mu.Unlock()
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []ContainerRef
	for id := range r.created {
		st := r.state(id)
		out = append(out, r.labelled(ContainerRef{ID: id, Name: st.Name, TaskID: st.TaskID, ShimHome: st.ShimHome, RunnerDir: st.RunnerDir, Running: st.Running}))
	}
	return out, nil
}

// labelled gives ref the labels the test set for it, if any; r.mu held.
func (r *refRuntime) labelled(ref ContainerRef) ContainerRef {
	if v, ok := r.taskOf[ref.ID]; ok {
		ref.TaskID = v
	}
	if v, ok := r.homeOf[ref.ID]; ok {
		ref.ShimHome = v
	}
	if v, ok := r.dirOf[ref.ID]; ok {
		ref.RunnerDir = v
	}
	return ref
}

func (r *refRuntime) Inspect(ctx context.Context, id string) (ContainerState, error) {
	st, err := r.stepRuntime.Inspect(ctx, id)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.inspects++
	ref := r.labelled(ContainerRef{ID: st.ID, TaskID: st.TaskID, ShimHome: st.ShimHome, RunnerDir: st.RunnerDir})
	st.TaskID, st.ShimHome, st.RunnerDir = ref.TaskID, ref.ShimHome, ref.RunnerDir
	return st, err
}

func (r *refRuntime) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := r.inspects
	r.inspects = 0
	return n
}

// A reconcile tick of a settled host lists and inspects nothing; a stray
// of this shim is inspected (once) and adopted, another shim's never (it
// is inspected once, for the GPUs it uses while it runs).
func TestReconcileInspectsOnlyWhatItDecides(t *testing.T) {
	rt := newRefRuntime()
	e, _ := newEngine(t, rt)
	for _, id := range []string{"a", "b", "c"} {
		if _, err := e.Submit(api.TaskConfig{ID: id, Name: id, ImageName: "img"}); err != nil {
			t.Fatal(err)
		}
		waitStatus(t, e, id, api.TaskRunning)
	}
	rt.count()
	if err := e.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := rt.count(); n != 0 {
		t.Fatalf("a tick with every task watched inspected %d containers", n)
	}
	ctx := context.Background()
	stray, err := rt.Create(ctx, ContainerSpec{Name: "s-1"})
	if err != nil {
		t.Fatal(err)
	}
	other, err := rt.Create(ctx, ContainerSpec{Name: "o-1"})
	if err != nil {
		t.Fatal(err)
	}
	rt.mu.Lock()
	rt.taskOf[stray], rt.homeOf[stray], rt.taskOf[other], rt.homeOf[other] = "s", e.cfg.Home, "o", "/another/shim"
	rt.mu.Unlock()
	if err := e.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if n := rt.count(); n != 2 {
		t.Fatalf("inspected %d containers, want the stray and the other shim's", n)
	}
	if info, err := e.Get("s"); err != nil || info.Status != api.TaskRunning {
		t.Fatalf("the stray: %+v %v", info, err)
	}
	if _, err := e.Get("o"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("another shim's container was adopted: %v", err)
	}
	if err := e.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if n := rt.count(); n != 0 {
		t.Fatalf("the tick after adopting inspected %d", n)
	}
}

// staleList answers Containers with a snapshot taken earlier: what the
// reconcile loop holds when a Remove lands between its list and adoption.
type staleList struct {
	*stepRuntime
	snap []ContainerState
}

func (s *staleList) Containers(context.Context) ([]ContainerState, error) { return s.snap, nil }

// TestRemovedTaskIsNeverAdoptedAgain: the list still shows a removed task's
// container; the tombstone keeps it from coming back, and a new submit under
// the same id is still accepted.
func TestRemovedTaskIsNeverAdoptedAgain(t *testing.T) {
	step := newStepRuntime()
	rt := &staleList{stepRuntime: step}
	e, _ := newEngine(t, rt)
	if _, err := e.Submit(api.TaskConfig{ID: "a", Name: "a", ImageName: "img"}); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, e, "a", api.TaskRunning)
	live, _ := step.Containers(context.Background())
	for i := range live {
		live[i].TaskID, live[i].Running = "a", true
	}
	rt.snap = live
	ctx := context.Background()
	if _, err := e.Terminate(ctx, "a", api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByServer}); err != nil {
		t.Fatal(err)
	}
	if err := e.Remove(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if err := e.Reconcile(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := e.Get("a"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("a removed task came back: %v", err)
	}
	e.Sync()
	if _, err := os.Stat(filepath.Join(e.cfg.Home, "tasks", "a.json")); err == nil {
		t.Fatal("its record was written again")
	}
	rt.snap = nil
	if _, err := e.Submit(api.TaskConfig{ID: "a", Name: "a", ImageName: "img"}); err != nil {
		t.Fatalf("a new submit under the removed id: %v", err)
	}
	waitStatus(t, e, "a", api.TaskRunning)
}

func TestTombstonesAreBounded(t *testing.T) {
	e, _ := newEngine(t, newStepRuntime())
	now := time.Unix(1000, 0)
	e.now = func() time.Time { return now }
	e.mu.Lock()
	for i := range maxTombstones + 100 {
		now = now.Add(time.Millisecond)
		e.bury(strconv.Itoa(i))
	}
	n := len(e.tombstones)
	first, last := e.buried("0"), e.buried(strconv.Itoa(maxTombstones+99))
	now = now.Add(tombstoneTTL + time.Second)
	expired := e.buried(strconv.Itoa(maxTombstones + 99))
	e.mu.Unlock()
	if n > maxTombstones || first || !last || expired {
		t.Fatalf("n=%d first=%v last=%v expired=%v", n, first, last, expired)
	}
}

// dockerDown answers every Docker call with the error a host without a
// daemon gives, and counts the removes it was asked for.
type dockerDown struct {
	*stepRuntime
	removes int
}

//lint:ignore ST1005 Docker's own message, word for word
var errNoDaemon = errors.New("Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?")

func (d *dockerDown) ImagePresent(context.Context, string) (bool, error) { return false, errNoDaemon }
func (d *dockerDown) Pull(context.Context, string, RegistryAuth) (io.ReadCloser, error) {
	return nil, errNoDaemon
}
func (d *dockerDown) Remove(context.Context, string) error { d.removes++; return errNoDaemon }
func (d *dockerDown) Containers(context.Context) ([]ContainerState, error) {
	return nil, errNoDaemon
}

// TestTaskWithoutContainerIsRemovedWithoutDocker: on a host whose Docker is
// missing, a task fails before create; removing it must not need Docker,
// neither at once nor after a restart, while a task that reached create
// still asks Docker.
func TestTaskWithoutContainerIsRemovedWithoutDocker(t *testing.T) {
	rt := &dockerDown{stepRuntime: newStepRuntime()}
	e1, _ := newEngine(t, rt)
	ctx := context.Background()
	for _, id := range []string{"a", "b"} {
		if _, err := e1.Submit(api.TaskConfig{ID: id, Name: id, ImageName: "img"}); err != nil {
			t.Fatal(err)
		}
		info := waitStatus(t, e1, id, api.TaskTerminated)
		if !strings.Contains(info.TerminationMessage, "Cannot connect to the Docker daemon") {
			t.Fatalf("the task must say why: %+v", info)
		}
	}
	if err := e1.Remove(ctx, "a"); err != nil {
		t.Fatalf("remove without Docker: %v", err)
	}
	e1.Sync()
	e2 := New(e1.cfg, rt, gpu.NewLocks(nil), nil, logging.Discard())
	t.Cleanup(e2.Sync)
	_ = e2.Restore(ctx) // Docker's half is incomplete; the records load
	if err := e2.Remove(ctx, "b"); err != nil {
		t.Fatalf("remove after a restart without Docker: %v", err)
	}
	if rt.removes != 0 {
		t.Fatalf("Docker was asked to remove %d containers that never existed", rt.removes)
	}
	if _, err := os.Stat(filepath.Join(e1.cfg.Home, "tasks", "b.json")); !os.IsNotExist(err) {
		t.Fatalf("the record stays: %v", err)
	}

	// A record from before its task ended may predate create: Docker is asked.
	e3, _ := newEngine(t, rt)
	if _, err := e3.Submit(api.TaskConfig{ID: "c", Name: "c", ImageName: "img"}); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, e3, "c", api.TaskTerminated)
	e3.Sync()
	l := loaded{rec: record{Config: api.TaskConfig{ID: "c", Name: "c"}, Status: api.TaskCreating, Held: held{Container: heldContainer{None: true}}}}
	if e3.restored(l).held.Container.None {
		t.Fatal("a creating record must not be trusted to have no container")
	}
}

// TestRestoreProbesARecordBeforeRunning: running is written in the
// background, so a shim killed just after starting a container leaves a
// record that still says preparing while the server was told running. The
// restarted shim asks Docker: the started container is re-attached with its
// GPU (taken from the container, the record had none yet) locked again; a
// record with no container ends executor_error; one created and never
// started is removed.
func TestRestoreProbesARecordBeforeRunning(t *testing.T) {
	rt := newStepRuntime()
	e1, _ := newEngine(t, rt, "g0", "g1")
	e1.cfg.GPUVendor = api.GPUVendorNVIDIA // the container's device request names its GPU
	if _, err := e1.Submit(api.TaskConfig{ID: "a", Name: "a", ImageName: "img", GPU: 1}); err != nil {
		t.Fatal(err)
	}
	ia := waitStatus(t, e1, "a", api.TaskRunning)
	e1.Sync()
	// The record as the kill left it: the running write never landed.
	lag := func(id string, status api.TaskStatus) {
		path := filepath.Join(e1.cfg.Home, "tasks", id+".json")
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		var rec record
		if err := json.Unmarshal(b, &rec); err != nil {
			t.Fatal(err)
		}
		rec.Status, rec.Held.Container.ID, rec.Held.GPUs, rec.Held.Container.Ports = status, "", nil, nil
		if err := e1.recs.save(rec); err != nil {
			t.Fatal(err)
		}
	}
	lag("a", api.TaskPreparing)
	// b: its pipeline died mid-pull, no container. c: created, never started.
	for _, id := range []string{"b", "c"} {
		cfg := api.TaskConfig{ID: id, Name: id, ImageName: "img"}
		if err := e1.recs.save(record{Version: recordVersion, Config: cfg, Status: api.TaskPulling, Held: held{Container: heldContainer{Name: ContainerName(id, id)}}}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := rt.Create(context.Background(), ContainerSpec{Name: ContainerName("c", "c"),
		Labels: map[string]string{LabelIsTask: "true", LabelTaskID: "c", LabelShimHome: e1.cfg.Home}}); err != nil {
		t.Fatal(err)
	}
	rt.mu.Lock()
	cID := rt.names[ContainerName("c", "c")]
	rt.mu.Unlock()
	rt.neverStarted(cID)

	locks := gpu.NewLocks([]string{"g0", "g1"})
	e2 := New(e1.cfg, rt, locks, nil, logging.Discard())
	t.Cleanup(e2.Sync)
	if err := e2.Restore(context.Background()); err != nil {
		t.Fatal(err)
	}
	ra, err := e2.Get("a")
	if err != nil || ra.Status != api.TaskRunning || ra.ContainerID != ia.ContainerID || fmt.Sprint(ra.GPUIDs) != fmt.Sprint(ia.GPUIDs) {
		t.Fatalf("a lagging record must be re-attached:\n was %+v\n now %+v %v", ia, ra, err)
	}
	if locks.Free() != 1 {
		t.Fatalf("the re-attached task's GPU must be locked: free=%d", locks.Free())
	}
	rb, _ := e2.Get("b")
	if rb.Status != api.TaskTerminated || rb.TerminationReason != api.ReasonExecutorError || !strings.Contains(rb.TerminationMessage, "before the task's container started") {
		t.Fatalf("b: %+v", rb)
	}
	rc, _ := e2.Get("c")
	if rc.Status != api.TaskTerminated || rc.TerminationReason != api.ReasonExecutorError {
		t.Fatalf("c: %+v", rc)
	}
	rt.mu.Lock()
	cLeft := rt.created[cID]
	rt.mu.Unlock()
	if cLeft {
		t.Fatal("a container that never started must be removed")
	}
	// The settled record is written: a second restart finds it running.
	e2.Sync()
	if b, _ := os.ReadFile(filepath.Join(e1.cfg.Home, "tasks", "a.json")); !strings.Contains(string(b), `"status":"running"`) || !strings.Contains(string(b), ia.ContainerID) {
		t.Fatalf("record after settling: %s", b)
	}
	if _, err := e2.Terminate(context.Background(), "a", api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser}); err != nil {
		t.Fatal(err)
	}
	if locks.Free() != 2 {
		t.Fatalf("free after a ended: %d", locks.Free())
	}
}

// TestProbedTaskWaitsForDocker: with Docker down at restart, a record before
// running keeps its status (neither ended nor called running) and what it
// holds stays claimed; once Docker answers, Reconcile settles it.
func TestProbedTaskWaitsForDocker(t *testing.T) {
	rt := newStepRuntime()
	e1, _ := newEngine(t, rt, "g0")
	cfg := api.TaskConfig{ID: "a", Name: "a", ImageName: "img", GPU: 1}
	if _, err := e1.Submit(cfg); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, e1, "a", api.TaskRunning)
	e1.Sync()
	if err := e1.recs.save(record{Version: recordVersion, Config: cfg, Status: api.TaskCreating, Held: held{Container: heldContainer{Name: ContainerName("a", "a")}, GPUs: []string{"g0"}}}); err != nil {
		t.Fatal(err)
	}
	down := &flakyContainers{stepRuntime: rt, down: true}
	locks := gpu.NewLocks([]string{"g0"})
	e2 := New(e1.cfg, down, locks, nil, logging.Discard())
	t.Cleanup(e2.Sync)
	if err := e2.Restore(context.Background()); err == nil {
		t.Fatal("restore must report that Docker did not answer")
	}
	if info, _ := e2.Get("a"); info.Status != api.TaskCreating {
		t.Fatalf("before Docker answers: %+v", info)
	}
	if locks.Free() != 0 {
		t.Fatal("the recorded GPU must stay claimed while Docker is asked")
	}
	down.setDown(false)
	if err := e2.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if info, _ := e2.Get("a"); info.Status != api.TaskRunning {
		t.Fatalf("after Docker answered: %+v", info)
	}

	// A terminate while the task is still probed stops its container by
	// name and settles it at once: ended with the stop's reason, its GPU
	// given back.
	e3 := New(e1.cfg, &flakyContainers{stepRuntime: rt, down: true}, gpu.NewLocks([]string{"g0"}), nil, logging.Discard())
	t.Cleanup(e3.Sync)
	e2.Sync()
	if err := e1.recs.save(record{Version: recordVersion, Config: cfg, Status: api.TaskCreating, Held: held{Container: heldContainer{Name: ContainerName("a", "a")}, GPUs: []string{"g0"}}}); err != nil {
		t.Fatal(err)
	}
	_ = e3.Restore(context.Background())
	// Docker still without a list of containers: nothing can say whether
	// it runs, so the terminate fails (the server retries) and the task
	// keeps its status.
	var stopErr *StopError
	if _, err := e3.Terminate(context.Background(), "a", api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser}); !errors.As(err, &stopErr) {
		t.Fatalf("terminate while Docker cannot list: %v", err)
	}
	if info, _ := e3.Get("a"); info.Status != api.TaskCreating {
		t.Fatalf("after a failed terminate: %+v", info)
	}
	e3.rt.(*flakyContainers).setDown(false)
	info, err := e3.Terminate(context.Background(), "a", api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser})
	if err != nil || info.Status != api.TaskTerminated || info.TerminationReason != api.ReasonTerminatedByUser {
		t.Fatalf("terminate of a probed task: %+v %v", info, err)
	}
	// Only the settled path gives the GPU back (a terminate that timed
	// out waiting would not).
	if e3.gpus.Free() != 1 {
		t.Fatal("the terminated task's GPU must be given back")
	}
}

// flakyContainers is a runtime whose container list fails while down.
type flakyContainers struct {
	*stepRuntime
	mu   sync.Mutex
	down bool
}

func (f *flakyContainers) setDown(v bool) { f.mu.Lock(); f.down = v; f.mu.Unlock() }

func (f *flakyContainers) Containers(ctx context.Context) ([]ContainerState, error) {
	f.mu.Lock()
	down := f.down
	f.mu.Unlock()
	if down {
		return nil, errors.New("Cannot connect to the Docker daemon")
	}
	return f.stepRuntime.Containers(ctx)
}

// recForwarder records what the engine forwards.
type recForwarder struct {
	mu     sync.Mutex
	opens  [][]api.PortMapping // the want of each Open
	closed []string
	next   int
}

func (f *recForwarder) Open(taskID, ip string, ports []int, want []api.PortMapping) ([]api.PortMapping, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.opens = append(f.opens, want)
	var out []api.PortMapping
	for _, p := range ports {
		host := 0
		for _, w := range want {
			if w.Container == p {
				host = w.Host
			}
		}
		if host == 0 {
			f.next++
			host = 40000 + f.next
		}
		out = append(out, api.PortMapping{Host: host, Container: p})
	}
	return out, nil
}

func (f *recForwarder) Close(taskID string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.closed = append(f.closed, taskID)
}

// TestBridgePortsForwardedAndReopened: a bridge task's runner ports are the
// forwarder's (the task reports its mappings), a restarted shim opens them
// again on the ports the server was told, and the task's end closes them.
func TestBridgePortsForwardedAndReopened(t *testing.T) {
	rt := newStepRuntime()
	e1, _ := newEngine(t, rt)
	f := &recForwarder{}
	e1.cfg.Forwarder = f
	if _, err := e1.Submit(api.TaskConfig{ID: "br", Name: "br", ImageName: "img", NetworkMode: "bridge"}); err != nil {
		t.Fatal(err)
	}
	info := waitStatus(t, e1, "br", api.TaskRunning)
	want := []api.PortMapping{{Host: 40001, Container: 10999}, {Host: 40002, Container: 10022}}
	if !slices.Equal(info.Ports, want) || info.Tandem.RunnerHTTPPort != 40001 || info.Tandem.RunnerSSHPort != 40002 {
		t.Fatalf("ports %+v details %+v", info.Ports, info.Tandem)
	}
	e1.Sync()

	e2 := New(e1.cfg, rt, gpu.NewLocks(nil), nil, logging.Discard())
	t.Cleanup(e2.Sync)
	if err := e2.Restore(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got, _ := e2.Get("br"); !slices.Equal(got.Ports, want) {
		t.Fatalf("restored ports %+v", got.Ports)
	}
	f.mu.Lock()
	if len(f.opens) != 2 || !slices.Equal(f.opens[1], want) {
		t.Fatalf("the restart did not re-open the told ports: %+v", f.opens)
	}
	f.mu.Unlock()
	if _, err := e2.Terminate(context.Background(), "br", api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser}); err != nil {
		t.Fatal(err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if !slices.Contains(f.closed, "br") {
		t.Fatalf("the ended task's forwards stay open: %v", f.closed)
	}
}

// dstackTask creates a container shaped like one dstack's own shim (at
// dstackHome) runs: its two labels, no shim-home label, its runner dir
// bound at /tmp/runner; labelHome != "" labels it as a Tandem shim at that
// home does.
func dstackTask(t *testing.T, rt Runtime, id, dstackHome, labelHome string, gpus ...string) string {
	t.Helper()
	name := ContainerName(id, id)
	spec := ContainerSpec{Name: name, Labels: map[string]string{LabelIsTask: "true", LabelTaskID: id},
		Binds: []Bind{{Source: filepath.Join(dstackHome, "runners", name), Target: RunnerDirInContainer}}}
	if labelHome != "" {
		spec.Labels[LabelShimHome] = labelHome
	}
	if len(gpus) > 0 {
		spec.GPUs = &GPURequest{DeviceIDs: gpus}
	}
	cid, err := rt.Create(context.Background(), spec)
	if err != nil {
		t.Fatal(err)
	}
	return cid
}

// TestForeignContainersAreLeftAlone: a shim with a scratch home beside the
// dstack server's tasks (run by dstack's agents at /root/.dstack) and
// another shim's lists none of them, can stop or remove none, and still
// gives none of its tasks a GPU a running one of them uses; the GPU is
// free again once that container stopped.
func TestForeignContainersAreLeftAlone(t *testing.T) {
	rt := newRefRuntime()
	e, locks := newEngine(t, rt, "g0", "g1")
	ctx := context.Background()
	dstack := dstackTask(t, rt, "dstack-job", "/root/.dstack", "", "g0")
	other := dstackTask(t, rt, "other-job", "/tmp/other-shim", "/tmp/other-shim")
	if err := rt.Stop(ctx, other, 0); err != nil { // a finished task: what prune would remove
		t.Fatal(err)
	}
	for range 2 {
		if err := e.Reconcile(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if l := e.List(); len(l) != 0 {
		t.Fatalf("the shim lists other agents' tasks: %+v", l)
	}
	for _, id := range []string{"dstack-job", "other-job"} {
		if _, err := e.Get(id); !errors.Is(err, ErrNotFound) {
			t.Errorf("get %s: %v", id, err)
		}
		if _, err := e.Terminate(ctx, id, api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser}); !errors.Is(err, ErrNotFound) {
			t.Errorf("terminate %s: %v", id, err)
		}
		if err := e.Remove(ctx, id); !errors.Is(err, ErrNotFound) {
			t.Errorf("remove %s: %v", id, err)
		}
	}
	if n := rt.live(); n != 2 || !running(t, rt, dstack) {
		t.Fatalf("containers left: %d, dstack's running: %v", n, running(t, rt, dstack))
	}
	// g0 is the dstack job's: a task asking for two cannot have them, one
	// asking for one gets g1.
	if _, err := e.Submit(api.TaskConfig{ID: "two", Name: "two", ImageName: "img", GPU: 2}); err != nil {
		t.Fatal(err)
	}
	if info := waitStatus(t, e, "two", api.TaskTerminated); info.TerminationReason != api.ReasonExecutorError {
		t.Fatalf("a task was given the GPU another agent's job uses: %+v", info)
	}
	if _, err := e.Submit(api.TaskConfig{ID: "one", Name: "one", ImageName: "img", GPU: 1}); err != nil {
		t.Fatal(err)
	}
	if info := waitStatus(t, e, "one", api.TaskRunning); !slices.Equal(info.GPUIDs, []string{"g1"}) {
		t.Fatalf("one: %+v", info)
	}
	if err := rt.Stop(ctx, dstack, 0); err != nil {
		t.Fatal(err)
	}
	if err := e.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if locks.Free() != 1 {
		t.Fatalf("the stopped container's GPU is not free again: free=%d", locks.Free())
	}
	if rt.live() != 3 {
		t.Fatalf("containers: %d, want both foreign ones and one's", rt.live())
	}
}

// TestAdoptsUnlabelledOnlyForTheMigration: an unlabelled container whose
// runner dir is under this shim's home was made by dstack's shim with
// this home (the shim it replaces): adopted. One from elsewhere is adopted
// only with AdoptUnlabelled; one labelled with another home never.
func TestAdoptsUnlabelledOnlyForTheMigration(t *testing.T) {
	rt := newRefRuntime()
	e, _ := newEngine(t, rt)
	ctx := context.Background()
	dstackTask(t, rt, "same-home", e.cfg.Home, "")
	dstackTask(t, rt, "elsewhere", "/root/.dstack", "")
	dstackTask(t, rt, "other-shim", "/tmp/other-shim", "/tmp/other-shim")
	if err := e.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if info, err := e.Get("same-home"); err != nil || info.Status != api.TaskRunning {
		t.Fatalf("dstack's task of this home: %+v %v", info, err)
	}
	for _, id := range []string{"elsewhere", "other-shim"} {
		if _, err := e.Get(id); !errors.Is(err, ErrNotFound) {
			t.Fatalf("%s adopted without the flag: %v", id, err)
		}
	}

	e2 := New(e.cfg, rt, gpu.NewLocks(nil), nil, logging.Discard())
	e2.cfg.AdoptUnlabelled = true
	t.Cleanup(e2.Sync)
	if err := e2.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"same-home", "elsewhere"} {
		if info, err := e2.Get(id); err != nil || info.Status != api.TaskRunning {
			t.Fatalf("%s with --adopt-unlabeled: %+v %v", id, info, err)
		}
	}
	if _, err := e2.Get("other-shim"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("another shim's container adopted with --adopt-unlabeled: %v", err)
	}
	// An adopted one is this shim's: terminate and remove reach it.
	if _, err := e2.Terminate(ctx, "elsewhere", api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser}); err != nil {
		t.Fatal(err)
	}
	if err := e2.Remove(ctx, "elsewhere"); err != nil {
		t.Fatal(err)
	}
	if rt.live() != 2 {
		t.Fatalf("containers after removing the adopted one: %d", rt.live())
	}
}

// TestForeignContainerUnderATaskName: another agent's container carries
// the name of a task of this shim (the same task name and id submitted to
// both) whose record lagged at a restart. Recovery does not take it for
// the task's, and neither terminate nor remove touches it.
func TestForeignContainerUnderATaskName(t *testing.T) {
	rt := newStepRuntime()
	e1, _ := newEngine(t, rt)
	cfg := api.TaskConfig{ID: "t", Name: "t", ImageName: "img"}
	for _, status := range []api.TaskStatus{api.TaskPulling, api.TaskPreparing} {
		t.Run(string(status), func(t *testing.T) {
			if err := e1.recs.save(record{Version: recordVersion, Config: cfg, Status: status, Held: held{Container: heldContainer{Name: ContainerName("t", "t")}}}); err != nil {
				t.Fatal(err)
			}
			foreign := dstackTask(t, rt, "t", "/tmp/other-shim", "/tmp/other-shim")
			e2 := New(e1.cfg, rt, gpu.NewLocks(nil), nil, logging.Discard())
			t.Cleanup(e2.Sync)
			ctx := context.Background()
			if status == api.TaskPreparing {
				// Terminated while still probed: the stop must not reach
				// the container under its name.
				down := &flakyContainers{stepRuntime: rt, down: true}
				e2 = New(e1.cfg, down, gpu.NewLocks(nil), nil, logging.Discard())
				t.Cleanup(e2.Sync)
				_ = e2.Restore(ctx)
				down.setDown(false)
				info, err := e2.Terminate(ctx, "t", api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser})
				if err != nil || info.Status != api.TaskTerminated {
					t.Fatalf("terminate: %+v %v", info, err)
				}
			} else if err := e2.Restore(ctx); err != nil {
				t.Fatal(err)
			}
			info, _ := e2.Get("t")
			if info.Status != api.TaskTerminated || info.ContainerID == foreign {
				t.Fatalf("the task took another agent's container: %+v", info)
			}
			if !running(t, rt, foreign) {
				t.Fatal("another agent's container was stopped")
			}
			if err := e2.Remove(ctx, "t"); err != nil {
				t.Fatal(err)
			}
			if rt.live() != 1 {
				t.Fatal("another agent's container was removed")
			}
			_ = rt.Remove(ctx, foreign)
		})
	}
}

// running says whether the test runtime's container id runs.
func running(t *testing.T, rt Runtime, id string) bool {
	t.Helper()
	st, err := rt.Inspect(context.Background(), id)
	return err == nil && st.Running
}

// TestForwardedDespitePublishedPorts: a bridge task whose container
// Docker publishes job ports for (tandem_publish) still has the shim's
// forwards for its runner's ports, so a restarted shim opens them again;
// one whose runner ports Docker publishes does not.
func TestForwardedDespitePublishedPorts(t *testing.T) {
	e, _ := newEngine(t, newStepRuntime())
	e.cfg.Forwarder = &recForwarder{}
	tk := &task{cfg: api.TaskConfig{NetworkMode: "bridge"}}
	if !e.forwarded(tk, ContainerState{Ports: []api.PortMapping{{Host: 8080, Container: 80}}}) {
		t.Error("a job's published port hid the shim's forwards")
	}
	if e.forwarded(tk, ContainerState{Ports: []api.PortMapping{{Host: 40001, Container: e.runnerPorts()[0]}}}) {
		t.Error("Docker-published runner ports read as forwarded")
	}
	if e.forwarded(&task{cfg: api.TaskConfig{NetworkMode: "host"}}, ContainerState{}) {
		t.Error("a host-network task read as forwarded")
	}
}
