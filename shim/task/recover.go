package task

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/shim/pull"
)

// Restore rebuilds the task table after a shim restart, from the records
// and the labelled containers. Every task the server knows keeps answering.
// The cases:
//
//  1. Record terminated: kept as is; if its resources were not released
//     (the shim died in between), they are released now.
//  2. Record before running (pending … pulling, or creating with no
//     container id yet): the pipeline died with the shim, but maybe after
//     it started the container (running is written in the background, so
//     the record can lag what the server was told). The task keeps its
//     status and what the record says it holds until Docker answers: a
//     started container is re-attached like 3–4; one never started is
//     removed and the task ends executor_error; no container ends it
//     executor_error saying the shim restarted before it started. A
//     creating record that names its container is settled like 3–5.
//  3. Record running, container running: re-attached. GPUs are re-locked
//     from the record (not recomputed), ports re-read, exit watched.
//  4. Record running, container stopped: terminated with its exit code and
//     log tail, like a live exit.
//  5. Record running, no container: terminated, the container disappeared.
//  6. Unreadable record: the task (named by its file) answers terminated,
//     executor_error, with the reason.
//  7. Task container without a record, this shim's (its home's label, or
//     no label and a runner dir under this home: dstack's own shim or an
//     older Tandem one that ran with this home): adopted. Running:
//     re-attached like 3. Stopped: terminated with its exit code.
//  8. Another agent's task container (labelled with another home, or
//     unlabelled with its runner dir elsewhere, unless --adopt-unlabeled):
//     left alone, never listed, stopped or removed, not even under a
//     task's name; the GPUs it uses while it runs are kept from this
//     shim's tasks (foreign.go's part below).
//
// Steps 3–5 and 7 need Docker. When it does not answer, running tasks stay
// running and Reconcile settles them once it does. The decisions themselves
// are pure functions in decide.go (decideRecord, decideHeld, decideStray),
// one table test each; this file only carries them out.
func (e *Engine) Restore(ctx context.Context) error {
	if e.recs == nil {
		return nil
	}
	began := e.now()
	e.recs.reserve.take() // from the start, before any job can fill the home
	loaded, err := e.recs.load()
	if err != nil {
		return err
	}
	actions := map[string]int{}
	defer func() { e.obs().Recovered(e.now().Sub(began), actions) }()
	for _, l := range loaded {
		t := e.restored(l)
		e.mu.Lock()
		e.tasks[t.cfg.ID] = t
		e.mu.Unlock()
		log := e.log.With("task_id", t.cfg.ID, "container", t.name)
		for _, r := range e.resources {
			if r, ok := r.(restorer); ok {
				r.restore(t, log)
			}
		}
		t.mu.Lock()
		view := recordView{readable: l.err == nil, status: t.status, hasContainer: t.held.Container.ID != "", released: t.released}
		t.mu.Unlock()
		a := decideRecord(view)
		log.Debug("recovery", "record_status", view.status, "action", a)
		actions[a.String()]++
		switch a {
		case actUnreadable:
			log.Error("unreadable task record", "err", l.err)
		case actRelease:
			e.release(t, log)
		case actHold:
			// A creating record with a container is settled as running.
			if view.status != api.TaskRunning {
				if err := e.transition(t, change{to: api.TaskRunning, recovered: true}); err != nil {
					log.Error("recovery cannot settle the task as running", "err", err)
				}
			}
			e.reclaim(t, log)
		case actProbe:
			t.mu.Lock()
			t.probing = true
			t.mu.Unlock()
			e.reclaim(t, log)
		}
		e.mustSave(t)
	}
	return e.Reconcile(ctx)
}

// dockerCallTimeout bounds each Docker call recovery makes: a hung daemon
// delays recovery, it never wedges it.
const dockerCallTimeout = 30 * time.Second

// cleanup runs a cleanup step that must not be cut halfway by the caller's
// cancellation (context.WithoutCancel) yet cannot hang (a timeout), and
// logs what it could not do.
func (e *Engine) cleanup(ctx context.Context, log *slog.Logger, what string, f func(context.Context) error) {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), dockerCallTimeout)
	defer cancel()
	if err := f(cctx); err != nil && !errors.Is(err, ErrContainerGone) {
		log.Warn("recovery cleanup failed", "step", what, "err", err)
	}
}

// restored builds a task from a record (or from a failed read). A task
// that ended before the restart has nothing left to run: its done is
// closed.
func (e *Engine) restored(l loaded) *task {
	t := &task{tracker: pull.NewTracker(e.now), cancelPre: func() {}, done: make(chan struct{})}
	if l.err != nil {
		t.cfg = api.TaskConfig{ID: l.id}
		t.status, t.reason = api.TaskTerminated, api.ReasonExecutorError
		t.message = fmt.Sprintf("the shim could not read this task's record after a restart: %v", l.err)
		t.released, t.held.Container.Ports, t.held.GPUs = true, []api.PortMapping{}, []string{}
		t.markDone()
		return t
	}
	r := l.rec
	t.cfg, t.status, t.reason, t.message = r.Config, r.Status, r.Reason, r.Message
	t.pwHash, t.created, t.job = r.PasswordHash, r.SubmittedAt, r.Job
	t.setHeld(r.Held, r.Status)
	t.released, t.stopReq, t.holding = r.Released, r.StopRequest, r.Holds
	if t.name == "" {
		t.name = ContainerName(r.Config.Name, r.Config.ID)
	}
	if t.status == api.TaskTerminated {
		t.markDone()
	}
	return t
}

// Reconcile settles running tasks that are not watched yet against the
// containers Docker has (cases 3–5, 7). It is idempotent; the shim calls it
// at start and on every tick until Docker answers.
func (e *Engine) Reconcile(ctx context.Context) error {
	conts, foreign, err := e.reconcileView(ctx)
	if err != nil {
		return fmt.Errorf("reconcile: %w", err)
	}
	e.holdForeign(conts, foreign)
	// By id for what a record names (the record is this shim's word); by
	// name only this shim's own: a container of another agent may carry
	// the name (the same task name and id submitted to both).
	byID, byName := map[string]ContainerState{}, map[string]ContainerState{}
	byTask := map[string]bool{}
	for _, c := range conts {
		byID[c.ID] = c
		if e.adoptable(c.ShimHome, c.RunnerDir) {
			byName[c.Name] = c
		}
	}
	e.mu.RLock()
	all := make([]*task, 0, len(e.tasks))
	for _, t := range e.tasks {
		byTask[t.cfg.ID] = true
		all = append(all, t)
	}
	e.mu.RUnlock()
	var pending []*task
	for _, t := range all {
		t.mu.Lock()
		if t.awaitsReconcile() {
			t.watched = true
			pending = append(pending, t)
		}
		t.mu.Unlock()
	}
	for _, t := range pending {
		log := e.log.With("task_id", t.cfg.ID, "container", t.name)
		t.mu.Lock()
		contID, probed := t.held.Container.ID, t.probing
		t.mu.Unlock()
		c, ok := byID[contID]
		if !ok {
			c, ok = byName[t.name]
			ok = ok && c.TaskID == t.cfg.ID
		}
		a := decideHeld(containerView{found: ok, neverStarted: c.NeverStarted, probed: probed})
		log.Debug("recovery", "action", a, "container_id", c.ID)
		switch a {
		case actEndGone:
			e.end(t, log, failure{api.ReasonContainerExitedWithError, "the container disappeared while the shim was down"})
		case actFailNeverRan:
			e.end(t, log, failure{api.ReasonExecutorError, "the shim restarted before the task's container started; submit it again"})
		case actEndNeverStarted:
			e.cleanup(ctx, log, "remove a container that never started", func(ctx context.Context) error { return e.rt.Remove(ctx, c.ID) })
			e.end(t, log, failure{api.ReasonExecutorError, "the shim restarted before starting the container; submit it again"})
		case actAttach: // a stopped container ends at once in watch
			if probed && !e.settleProbed(t, c, log) {
				continue
			}
			for _, r := range e.resources {
				if r, ok := r.(reattacher); ok {
					r.reattach(ctx, t, c, log)
				}
			}
			t.mu.Lock()
			gpus := t.held.GPUs
			t.mu.Unlock()
			e.mustSave(t)
			log.Info("re-attached to a running task", "container_id", c.ID, "gpus", gpus)
			e.follow(t, log)
			if c.Running {
				e.resumeStop(t, log)
			}
		}
	}
	// 7, 8: task containers nobody here has a record of.
	for _, c := range conts {
		if c.TaskID == "" || byTask[c.TaskID] {
			continue
		}
		e.adopt(c) // decides again under the lock: the task table may have moved
	}
	return nil
}

// resumeStop carries on a terminate asked before the restart whose stop
// had not ended (the shim died during it): the task still runs, and the
// server, which may have been told nothing, need not ask again.
func (e *Engine) resumeStop(t *task, log *slog.Logger) {
	t.mu.Lock()
	req := t.stopReq
	t.mu.Unlock()
	if req == nil {
		return
	}
	log.Info("resuming a terminate asked before the restart", "reason", req.TerminationReason)
	e.stops.Add(1)
	go func() {
		defer e.stops.Done()
		if _, err := e.Terminate(e.life, t.cfg.ID, *req); err != nil && e.life.Err() == nil {
			log.Warn("resuming a terminate asked before the restart", "err", err)
		}
	}()
}

// settleProbed moves a probed task whose container started to running: the
// record lagged, the job runs. GPUs the record did not list yet are taken
// from the container's label and locked with the rest. It reports false
// when the task cannot be settled (it is ended instead).
func (e *Engine) settleProbed(t *task, c ContainerState, log *slog.Logger) bool {
	err := e.transition(t, change{to: api.TaskRunning, recovered: true, update: func() {
		t.probing, t.held.Container.ID = false, c.ID
		if len(t.held.GPUs) == 0 && len(c.GPUIDs) > 0 {
			t.held.GPUs = slices.Clone(c.GPUIDs)
		}
	}})
	if err != nil {
		log.Error("recovery cannot settle the task as running", "err", err)
		e.cleanup(context.Background(), log, "stop the container of a task that cannot be settled", func(ctx context.Context) error { return e.rt.Stop(ctx, c.ID, 0) })
		e.end(t, log, failure{api.ReasonExecutorError, fmt.Sprintf("the shim restarted while the task started and cannot settle it: %v", err)})
		return false
	}
	e.reclaim(t, log)
	log.Info("the task's container started before the shim restarted; its record lagged", "container_id", c.ID)
	return true
}

// follow watches an attached task's container in the background.
func (e *Engine) follow(t *task, log *slog.Logger) {
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		e.watch(t, log) // ends the task (or marks it done at shutdown)
	}()
}

// adopt takes over a labelled container that has no record, as decideStray
// says: running, or terminated with the container's exit. The task is made
// in that status before it enters the table; nothing moves it until it does.
func (e *Engine) adopt(c ContainerState) {
	log := e.log.With("task_id", c.TaskID, "container", c.Name)
	e.mu.Lock()
	a := e.strayOf(c.TaskID, c.ShimHome, c.RunnerDir, c.Running)
	if a != actAdoptRunning && a != actAdoptStopped {
		e.mu.Unlock()
		return
	}
	t := e.adopted(c, a == actAdoptRunning)
	e.tasks[c.TaskID] = t
	e.mu.Unlock()
	if a == actAdoptStopped {
		e.mustSave(t)
		log.Info("adopted a stopped task container", "exit_code", c.ExitCode)
		return
	}
	e.reclaim(t, log)
	e.mustSave(t)
	log.Info("adopted a running task container", "gpus", c.GPUIDs)
	e.follow(t, log)
}

// adopted is the task of an adopted container c: running (watched from
// here on), or terminated with its exit and holding nothing.
func (e *Engine) adopted(c ContainerState, running bool) *task {
	t := &task{cfg: api.TaskConfig{ID: c.TaskID, Name: c.Name, ContainerUser: "root", NetworkMode: "host"},
		tracker: pull.NewTracker(e.now), cancelPre: func() {}, done: make(chan struct{}),
		name: c.Name, held: held{Container: heldContainer{ID: c.ID, Ports: c.Ports}, GPUs: c.GPUIDs}}
	if t.held.GPUs == nil {
		t.held.GPUs = []string{}
	}
	if running {
		t.status, t.watched = api.TaskRunning, true
		return t
	}
	t.status, t.reason, t.released = api.TaskTerminated, api.ReasonDoneByRunner, true
	if c.ExitCode != 0 {
		t.reason = api.ReasonContainerExitedWithError
		t.message = fmt.Sprintf("container exited with code %d (adopted after a shim restart)", c.ExitCode)
	}
	t.markDone()
	return t
}

// strayOf decides a task container of task id, labelled with labelHome and
// bound to runnerDir, that may have no task here (decideStray); e.mu held.
// Whether it runs matters only once it is adopted.
func (e *Engine) strayOf(id, labelHome, runnerDir string, running bool) action {
	_, known := e.tasks[id]
	return decideStray(strayView{taskID: id, known: known, removed: e.buried(id), running: running,
		foreign: !e.adoptable(labelHome, runnerDir)})
}

// adoptable says whether a container labelled with labelHome and bound to
// runnerDir is this shim's to take, stop and remove (ownerOf, adoptable).
func (e *Engine) adoptable(labelHome, runnerDir string) bool {
	return adoptable(ownerOf(labelHome, runnerDir, e.cfg.Home), e.cfg.AdoptUnlabelled)
}

// awaitsReconcile says whether Reconcile must still settle t against its
// container: running or probed, and not watched yet; t.mu held.
func (t *task) awaitsReconcile() bool {
	return (t.status == api.TaskRunning || t.probing && t.status != api.TaskTerminated) && !t.watched
}

// ContainerRef is a labelled container as Docker's list shows it.
type ContainerRef struct {
	ID, Name, TaskID string
	ShimHome         string // LabelShimHome ("" if unknown)
	RunnerDir        string // host side of its bind at RunnerDirInContainer ("" if none)
	Running          bool
}

// refLister is a runtime that lists its labelled containers without
// inspecting each.
type refLister interface {
	ContainerRefs(ctx context.Context) ([]ContainerRef, error)
}

// reconcileView is the containers Reconcile decides on, and every other
// agent's task container the list shows (foreign). From a runtime that
// lists cheaply, only those a decision needs are inspected: the containers
// of tasks not watched yet, task containers of this shim that no task has
// (strays not just removed), and other agents' running containers whose
// GPUs are not held yet. A settled host's tick is then one list call: it
// was an inspect of every task's container every 5 s (64 a tick with 64
// tasks, queued with the starts of a burst in Docker).
func (e *Engine) reconcileView(ctx context.Context) ([]ContainerState, []ContainerRef, error) {
	lctx, cancel := context.WithTimeout(ctx, dockerCallTimeout)
	defer cancel()
	l, ok := e.rt.(refLister)
	if !ok {
		conts, err := e.rt.Containers(lctx)
		if err != nil {
			return nil, nil, err
		}
		var foreign []ContainerRef
		for _, c := range conts {
			if !e.adoptable(c.ShimHome, c.RunnerDir) {
				foreign = append(foreign, ContainerRef{ID: c.ID, Name: c.Name, TaskID: c.TaskID, ShimHome: c.ShimHome, RunnerDir: c.RunnerDir, Running: c.Running})
			}
		}
		return conts, foreign, nil
	}
	refs, err := l.ContainerRefs(lctx)
	if err != nil {
		return nil, nil, err
	}
	ids, names := map[string]bool{}, map[string]bool{}
	var need []string
	e.mu.RLock()
	for _, t := range e.tasks {
		t.mu.Lock()
		if t.awaitsReconcile() {
			if t.held.Container.ID != "" {
				ids[t.held.Container.ID] = true
			}
			names[t.name] = true
		}
		t.mu.Unlock()
	}
	var foreign []ContainerRef
	for _, r := range refs {
		own := e.adoptable(r.ShimHome, r.RunnerDir)
		if !own {
			foreign = append(foreign, r)
		}
		switch {
		case ids[r.ID] || names[r.Name]:
			need = append(need, r.ID)
		case !own:
			if r.Running && !e.foreignHeld(r.ID) {
				need = append(need, r.ID) // for the GPUs it uses
			}
		case e.strayOf(r.TaskID, r.ShimHome, r.RunnerDir, false) != actSkip:
			need = append(need, r.ID)
		}
	}
	e.mu.RUnlock()
	out := make([]ContainerState, 0, len(need))
	for _, id := range need {
		st, err := e.rt.Inspect(lctx, id)
		if errors.Is(err, ErrContainerGone) {
			continue // removed between the list and the inspect
		}
		if err != nil {
			return nil, nil, err
		}
		out = append(out, st)
	}
	return out, foreign, nil
}

// ReconcileLoop retries Reconcile every interval until ctx ends: it settles
// what Docker could not answer for at start, and adopts new strays.
func (e *Engine) ReconcileLoop(ctx context.Context, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if err := e.Reconcile(ctx); err != nil {
				e.log.Debug("reconcile", "err", err)
			}
		}
	}
}

// foreignHolds are the GPUs other agents' running task containers use. Each
// is locked in the engine's gpu.Locks under the container's name, so that
// none of this shim's tasks is given a GPU a job it does not own computes
// on (adopting those containers had locked them; leaving them alone must
// not free them).
type foreignHolds struct {
	mu     sync.Mutex          // guards the fields below; taken after Engine.mu, never with a task's
	gpus   map[string][]string // running foreign container id → the GPUs it names
	logged bool                // the first reconcile's count of containers left alone was logged
}

// foreignHolder names a foreign container as the holder of its GPUs.
func foreignHolder(id string) string { return "another agent's container " + id[:min(12, len(id))] }

// foreignHeld says whether the GPUs of foreign container id are held.
func (e *Engine) foreignHeld(id string) bool {
	e.foreign.mu.Lock()
	defer e.foreign.mu.Unlock()
	_, ok := e.foreign.gpus[id]
	return ok
}

// holdForeign keeps the GPUs of the foreign containers that run (foreign,
// from the list) locked, and gives back those of the ones that stopped or
// went. A new one's GPUs come from its inspect, in conts. The first call
// logs how many containers were left alone, and why.
func (e *Engine) holdForeign(conts []ContainerState, foreign []ContainerRef) {
	states := make(map[string]ContainerState, len(conts))
	for _, c := range conts {
		states[c.ID] = c
	}
	f := &e.foreign
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.gpus == nil {
		f.gpus = map[string][]string{}
	}
	running := map[string]bool{}
	for _, r := range foreign {
		if !r.Running {
			continue
		}
		ids, held := f.gpus[r.ID]
		if !held {
			st, ok := states[r.ID]
			if !ok || !st.Running {
				continue // stopped since the list: the next tick sees it
			}
			ids = slices.Clone(st.GPUIDs)
			f.gpus[r.ID] = ids
			if len(ids) > 0 {
				e.log.Info("GPUs in use by another agent's task container are kept from this shim's tasks", "container", r.Name, "container_id", st.ID, "gpus", ids)
			}
		}
		running[r.ID] = true
		if e.gpus == nil {
			continue
		}
		// One at a time: a GPU one of this shim's tasks was given before
		// the container was seen is reported, the others still locked;
		// it is locked again each tick, so it is not handed out anew once
		// that task ends.
		for _, g := range ids {
			if err := e.gpus.Lock(foreignHolder(r.ID), []string{g}); err != nil && !held {
				e.log.Warn("a GPU another agent's container uses is held by a task of this shim", "container", r.Name, "gpu", g, "err", err)
			}
		}
	}
	for id, ids := range f.gpus {
		if !running[id] {
			if e.gpus != nil {
				e.gpus.Release(foreignHolder(id), ids)
			}
			delete(f.gpus, id)
		}
	}
	if f.logged {
		return
	}
	f.logged = true
	counts := map[owner]int{}
	for _, r := range foreign {
		counts[ownerOf(r.ShimHome, r.RunnerDir, e.cfg.Home)]++
	}
	if len(foreign) > 0 {
		e.log.Info("left other agents' task containers alone: not listed, stopped or removed", "containers", len(foreign),
			"labelled_other_home", counts[ownerOther], "unlabelled", counts[ownerUnlabelled],
			"why", "labelled with another shim's home, or unlabelled with a runner dir outside this home (dstack's shim with another home); --adopt-unlabeled takes the unlabelled ones")
	}
}

// removeOwn removes t's container: the one its record names, and the one
// under its name when that one is this shim's (a create whose answer was
// lost leaves a container whose id was never recorded). Another agent's
// container under the same name (the same task name and id submitted to
// both) is left alone.
func (e *Engine) removeOwn(ctx context.Context, t *task) error {
	t.mu.Lock()
	id, name := t.held.Container.ID, t.name
	t.mu.Unlock()
	if id != "" {
		if err := e.rt.Remove(ctx, id); err != nil {
			return err
		}
	}
	st, err := e.rt.Inspect(ctx, name)
	switch {
	case errors.Is(err, ErrContainerGone):
		return nil
	case err != nil:
		return err
	case st.TaskID != t.cfg.ID || !e.adoptable(st.ShimHome, st.RunnerDir):
		e.log.Warn("another agent's container carries this task's container name; left alone", "task_id", t.cfg.ID,
			"container", name, "container_id", st.ID, "its_shim_home", st.ShimHome, "its_runner_dir", st.RunnerDir)
		return nil
	}
	return e.rt.Remove(ctx, st.ID)
}
