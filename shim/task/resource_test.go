package task

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/shim/gpu"
)

// Each resource kind: acquire, release, reclaim after a restart (a fresh
// engine over the same home), and release of one never acquired.

type fakeKeys struct {
	mu    sync.Mutex
	lines map[string][]string // task id -> keys
	fail  error
	// removeFails: the next this many removals fail.
	removeFails int
	removeTries int
}

func (k *fakeKeys) Add(user, id string, keys []string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.fail != nil {
		return k.fail
	}
	k.lines[id] = keys
	return nil
}

func (k *fakeKeys) Remove(user, id string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.removeTries++
	if k.removeFails > 0 {
		k.removeFails--
		return errors.New("authorized_keys: read-only file system")
	}
	delete(k.lines, id)
	return nil
}

type fakeVolumes struct {
	mu      sync.Mutex
	mounted map[string]string // volume -> task id
	claims  []string
	// unmountFails: the next this many unmounts fail.
	unmountFails int
	unmountTries int
}

func (v *fakeVolumes) Mount(_ context.Context, id string, vi api.VolumeInfo) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if owner, ok := v.mounted[vi.Name]; ok && owner != id {
		return errors.New("mounted for another task")
	}
	v.mounted[vi.Name] = id
	return nil
}

func (v *fakeVolumes) Unmount(name, id string) error {
	v.mu.Lock()
	v.unmountTries++
	if v.unmountFails > 0 {
		v.unmountFails--
		v.mu.Unlock()
		return errors.New("umount: target is busy")
	}
	defer v.mu.Unlock()
	if v.mounted[name] == id {
		delete(v.mounted, name)
	}
	return nil
}

func (v *fakeVolumes) Claim(name, id string) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.claims = append(v.claims, name+"@"+id)
	return nil
}

type fakeNetwork struct{ ensured int }

func (n *fakeNetwork) Ensure(context.Context) (string, error) {
	n.ensured++
	return "tandem-isolated", nil
}

// resourceEngine is an engine with every resource backend faked.
func resourceEngine(t *testing.T, locks *gpu.Locks, keys *fakeKeys, vols *fakeVolumes, net *fakeNetwork, home string) *Engine {
	t.Helper()
	e := New(Config{Home: home, RunnerBinary: "/bin/true", Volumes: vols, Network: net,
		InfinibandPath: "/nonexistent/ib"}, newStepRuntime(), locks, keys, logging.Discard())
	t.Cleanup(e.Sync)
	return e
}

func newTask(cfg api.TaskConfig) *task {
	cfg = normalize(cfg)
	return &task{cfg: cfg, name: ContainerName(cfg.Name, cfg.ID), done: make(chan struct{})}
}

// hostKinds are the kinds that take the host's resources, acquired
// without a runner dir, an image or a container.
var hostKinds = []string{"gpus", "host_keys", "volumes", "instance_mounts", "network"}

// acquireHost acquires tk's host resources, in order, as a start does.
func acquireHost(t *testing.T, e *Engine, tk *task) {
	t.Helper()
	for _, r := range e.resources {
		if a, ok := r.(acquirer); ok && slices.Contains(hostKinds, r.kind()) {
			if f := a.acquire(&starting{ctx: context.Background(), t: tk}); f != nil {
				t.Fatalf("%T: %+v", r, f)
			}
		}
	}
}

func TestResources(t *testing.T) {
	home := t.TempDir()
	locks := gpu.NewLocks([]string{"g0", "g1"})
	keys := &fakeKeys{lines: map[string][]string{}}
	vols := &fakeVolumes{mounted: map[string]string{}}
	net := &fakeNetwork{}
	e := resourceEngine(t, locks, keys, vols, net, home)
	mountDir := filepath.Join(t.TempDir(), "data")
	tk := newTask(api.TaskConfig{ID: "a", Name: "a", ImageName: "img", GPU: 1, NetworkMode: "bridge",
		HostSSHUser: "ubuntu", HostSSHKeys: []string{"ssh-ed25519 AAAA a"},
		Volumes:        []api.VolumeInfo{{Name: "v1"}},
		InstanceMounts: []api.InstanceMountPoint{{InstancePath: mountDir, Path: "/data"}}})
	e.tasks[tk.cfg.ID] = tk // records are written only for tasks in the table

	acquireHost(t, e, tk)
	if locks.Free() != 1 || len(tk.held.GPUs) != 1 {
		t.Errorf("gpus: free %d, task %v", locks.Free(), tk.held.GPUs)
	}
	if len(keys.lines["a"]) != 1 || !tk.held.HostKeys {
		t.Errorf("keys: %v %v", keys.lines, tk.held.HostKeys)
	}
	if vols.mounted["v1"] != "a" {
		t.Errorf("volumes: %v", vols.mounted)
	}
	if st, err := os.Stat(mountDir); err != nil || !st.IsDir() {
		t.Errorf("instance mount dir: %v", err)
	}
	if net.ensured != 1 || tk.network != "tandem-isolated" {
		t.Errorf("network: ensured %d, task %q", net.ensured, tk.network)
	}
	if spec := e.containerSpec(tk, t.TempDir(), tk.held.GPUs); spec.NetworkMode != "tandem-isolated" {
		t.Errorf("spec network %q", spec.NetworkMode)
	}

	// The record says what is held: a restarted engine reclaims GPUs and
	// volumes without touching the host, and a second walk is harmless.
	tk.status, tk.held.Container.ID = api.TaskRunning, "c1"
	if err := e.save(tk); err != nil {
		t.Fatal(err)
	}
	loaded, err := e.recs.load()
	if err != nil || len(loaded) != 1 {
		t.Fatalf("load: %v %d", err, len(loaded))
	}
	locks2 := gpu.NewLocks([]string{"g0", "g1"})
	e2 := resourceEngine(t, locks2, keys, vols, net, home)
	restored := e2.restored(loaded[0])
	e2.reclaim(restored, e2.log)
	if locks2.Free() != 1 || !slices.Equal(restored.held.GPUs, tk.held.GPUs) {
		t.Errorf("reclaimed gpus: free %d, %v", locks2.Free(), restored.held.GPUs)
	}
	if !slices.Equal(vols.claims, []string{"v1@a"}) {
		t.Errorf("reclaimed volumes: %v", vols.claims)
	}
	if len(keys.lines["a"]) != 1 || net.ensured != 1 {
		t.Errorf("reclaim touched the host: keys %v, network ensured %d", keys.lines, net.ensured)
	}

	// Release, in reverse, exactly once; host data stays.
	e2.release(restored, e2.log)
	e2.release(restored, e2.log)
	if locks2.Free() != 2 || len(keys.lines) != 0 || len(vols.mounted) != 0 {
		t.Errorf("after release: free %d, keys %v, volumes %v", locks2.Free(), keys.lines, vols.mounted)
	}
	if _, err := os.Stat(mountDir); err != nil {
		t.Errorf("release removed host data: %v", err)
	}
}

// TestResourcesNeverAcquired: releasing a task that acquired nothing (it
// failed first, or asked for nothing) touches nothing that others hold.
func TestResourcesNeverAcquired(t *testing.T) {
	locks := gpu.NewLocks([]string{"g0"})
	keys := &fakeKeys{lines: map[string][]string{"other": {"k"}}}
	vols := &fakeVolumes{mounted: map[string]string{"v1": "other"}}
	e := resourceEngine(t, locks, keys, vols, &fakeNetwork{}, t.TempDir())
	if _, err := locks.Acquire("other", 1); err != nil {
		t.Fatal(err)
	}
	tk := newTask(api.TaskConfig{ID: "a", Name: "a", ImageName: "img", GPU: 1, HostSSHUser: "u", HostSSHKeys: []string{"k"},
		Volumes: []api.VolumeInfo{{Name: "v1"}}})
	for i := len(e.resources) - 1; i >= 0; i-- {
		if r, ok := e.resources[i].(releaser); ok {
			_ = r.release(tk, e.log)
		}
		if r, ok := e.resources[i].(reclaimer); ok {
			r.reclaim(tk, e.log)
		}
	}
	if locks.Free() != 0 || len(keys.lines["other"]) != 1 || vols.mounted["v1"] != "other" || len(vols.claims) != 0 {
		t.Errorf("a never-acquired release touched others: free %d, keys %v, volumes %v, claims %v", locks.Free(), keys.lines, vols.mounted, vols.claims)
	}
}

// TestResourceAcquireFailures: each kind refuses with its own message and
// reason, and what it recorded before failing is released.
func TestResourceAcquireFailures(t *testing.T) {
	locks := gpu.NewLocks([]string{"g0"})
	keys := &fakeKeys{lines: map[string][]string{}, fail: errors.New("no such user")}
	e := resourceEngine(t, locks, keys, &fakeVolumes{mounted: map[string]string{}}, &fakeNetwork{}, t.TempDir())
	cases := []struct {
		name   string
		r      acquirer
		cfg    api.TaskConfig
		reason api.TerminationReason
		msg    string
	}{
		{"gpus", gpuResource{e}, api.TaskConfig{GPU: 2}, api.ReasonExecutorError, ""},
		{"keys", hostKeysResource{e}, api.TaskConfig{HostSSHUser: "nobody", HostSSHKeys: []string{"k"}}, api.ReasonExecutorError, "host keys error: no such user"},
		{"volumes without support", volumesResource{&Engine{cfg: Config{}}}, api.TaskConfig{Volumes: []api.VolumeInfo{{Name: "v"}}}, api.ReasonExecutorError, "prepareVolumes error: this shim has no volume support configured"},
		{"relative mount", instanceMountsResource{e}, api.TaskConfig{InstanceMounts: []api.InstanceMountPoint{{InstancePath: "data", Path: "/data"}}}, api.ReasonExecutorError, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			c.cfg.ID, c.cfg.Name, c.cfg.ImageName = "t-"+c.name, "n", "img"
			tk := newTask(c.cfg)
			f := c.r.acquire(&starting{ctx: context.Background(), t: tk})
			if f == nil || f.reason != c.reason || (c.msg != "" && f.msg != c.msg) {
				t.Fatalf("got %+v", f)
			}
			if r, ok := c.r.(releaser); ok {
				_ = r.release(tk, e.log)
			}
		})
	}
	if locks.Free() != 1 {
		t.Errorf("a failed acquire kept a GPU: free %d", locks.Free())
	}
}

// TestFailedReleaseIsRetriedAndPersisted (issue 42, item 1), per kind that
// can fail: a release that fails leaves the kind in the task's record
// (holds), is retried with backoff until it is done, and a restart before
// that tries again only what is held. Remove refuses to forget a task that
// still holds something.
func TestFailedReleaseIsRetriedAndPersisted(t *testing.T) {
	cases := []struct {
		kind string
		fail func(k *fakeKeys, v *fakeVolumes, n int)
		held func(k *fakeKeys, v *fakeVolumes) bool
	}{
		{"host_keys", func(k *fakeKeys, _ *fakeVolumes, n int) { k.removeFails = n },
			func(k *fakeKeys, _ *fakeVolumes) bool { return len(k.lines["a"]) > 0 }},
		{"volumes", func(_ *fakeKeys, v *fakeVolumes, n int) { v.unmountFails = n },
			func(_ *fakeKeys, v *fakeVolumes) bool { return v.mounted["v1"] == "a" }},
	}
	for _, c := range cases {
		t.Run(c.kind, func(t *testing.T) {
			home := t.TempDir()
			keys := &fakeKeys{lines: map[string][]string{}}
			vols := &fakeVolumes{mounted: map[string]string{}}
			e := resourceEngine(t, gpu.NewLocks([]string{"g0"}), keys, vols, &fakeNetwork{}, home)
			e.releaseBackoff = 10 * time.Millisecond
			tk := newTask(api.TaskConfig{ID: "a", Name: "a", ImageName: "img", GPU: 1,
				HostSSHUser: "ubuntu", HostSSHKeys: []string{"ssh-ed25519 AAAA a"}, Volumes: []api.VolumeInfo{{Name: "v1"}}})
			e.tasks[tk.cfg.ID] = tk
			acquireHost(t, e, tk)
			tk.status = api.TaskTerminated
			tk.markDone()

			// Fails three times, then works: retried in the background.
			c.fail(keys, vols, 3)
			e.release(tk, e.log)
			tk.mu.Lock()
			held := slices.Clone(tk.holding)
			tk.mu.Unlock()
			if !slices.Equal(held, []string{c.kind}) {
				t.Fatalf("holding %v, want [%s]", held, c.kind)
			}
			e.Sync()
			if ls, _ := readRecords(e.recs.dir); len(ls) != 1 || ls[0].rec.Released || !slices.Equal(ls[0].rec.Holds, []string{c.kind}) {
				t.Fatalf("record: %+v", ls)
			}
			if err := e.Remove(context.Background(), "a"); !errors.Is(err, ErrConflict) && c.held(keys, vols) {
				t.Fatalf("remove of a task that still holds %s: %v", c.kind, err)
			}
			e.retries.Wait()
			if c.held(keys, vols) {
				t.Fatalf("%s still held after the retries", c.kind)
			}
			e.Sync()
			tk.mu.Lock()
			released := tk.released
			tk.mu.Unlock()
			if !released {
				t.Fatal("not marked released")
			}

			// A restart before the release succeeded: only what is held is
			// released again, and the record says when it is done.
			home2 := t.TempDir()
			keys2 := &fakeKeys{lines: map[string][]string{"a": {"k"}}}
			vols2 := &fakeVolumes{mounted: map[string]string{"v1": "a"}}
			e2 := resourceEngine(t, gpu.NewLocks([]string{"g0"}), keys2, vols2, &fakeNetwork{}, home2)
			tk2 := newTask(tk.cfg)
			tk2.status, tk2.held.HostKeys, tk2.held.Volumes, tk2.holding = api.TaskTerminated, true, []string{"v1"}, []string{c.kind}
			e2.tasks["a"] = tk2
			e2.release(tk2, e2.log)
			if c.held(keys2, vols2) {
				t.Fatalf("the held %s was not released at the restart", c.kind)
			}
			if keys2.removeTries+vols2.unmountTries != 1 {
				t.Fatalf("released %d kinds, want only the held one", keys2.removeTries+vols2.unmountTries)
			}
			e2.Sync()
			if ls, _ := readRecords(e2.recs.dir); len(ls) != 1 || !ls[0].rec.Released || len(ls[0].rec.Holds) != 0 {
				t.Fatalf("record after: %+v", ls)
			}
		})
	}
}

// TestTheListAndItsPhases pins a task's list: its order (a start acquires
// in it; release and remove walk it backwards, so the container is removed
// before its runner dir) and which phases each kind has.
func TestTheListAndItsPhases(t *testing.T) {
	e := New(Config{}, newStepRuntime(), gpu.NewLocks(nil), nil, logging.Discard())
	want := []struct {
		kind   string
		phases string // a: acquire, l: release, c: reclaim, t: reattach, r: remove, s: restore
	}{
		{"runner_dir", "a r s"}, {"gpus", "a l c"}, {"host_keys", "a l"}, {"volumes", "a l c"},
		{"instance_mounts", "a"}, {"network", "a"}, {"image", "a"}, {"container", "a t r"}, {"forwards", "a l t"},
	}
	if len(e.resources) != len(want) {
		t.Fatalf("%d kinds, want %d", len(e.resources), len(want))
	}
	for i, r := range e.resources {
		var ph []string
		if _, ok := r.(acquirer); ok {
			ph = append(ph, "a")
		}
		if _, ok := r.(releaser); ok {
			ph = append(ph, "l")
		}
		if _, ok := r.(reclaimer); ok {
			ph = append(ph, "c")
		}
		if _, ok := r.(reattacher); ok {
			ph = append(ph, "t")
		}
		if _, ok := r.(remover); ok {
			ph = append(ph, "r")
		}
		if _, ok := r.(restorer); ok {
			ph = append(ph, "s")
		}
		if got := strings.Join(ph, " "); r.kind() != want[i].kind || got != want[i].phases {
			t.Errorf("kind %d: %s with %q, want %s with %q", i, r.kind(), got, want[i].kind, want[i].phases)
		}
	}
}
