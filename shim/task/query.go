package task

// Queries: what the API reads.

import (
	"slices"
	"strings"
	"time"

	"github.com/tandem-run/tandem/api"
)

// Get returns one task. Its job's final state (Tandem's extension) is
// looked for in the runner dir at most every jobLookEvery.
func (e *Engine) Get(id string) (api.TaskInfoResponse, error) { return e.get(id, false) }

// GetFresh is Get that looks for the job's final state now: for a client
// that acts on it (tandem rm right after the job ended), not a poller.
func (e *Engine) GetFresh(id string) (api.TaskInfoResponse, error) { return e.get(id, true) }

func (e *Engine) get(id string, fresh bool) (api.TaskInfoResponse, error) {
	t, ok := e.lookup(id)
	if !ok {
		return api.TaskInfoResponse{}, ErrNotFound
	}
	now := e.now()
	t.mu.Lock()
	look := t.job == nil && (t.status == api.TaskRunning || t.status == api.TaskTerminated) && t.held.Container.ID != "" &&
		(fresh || now.Sub(t.jobLooked) >= jobLookEvery)
	if look {
		t.jobLooked = now
	}
	lookKeys := t.status == api.TaskRunning && t.hostKeys == nil && (fresh || now.Sub(t.keysLooked) >= keysSpacing(t.keysLooks))
	if lookKeys {
		t.keysLooked = now
		if !fresh {
			t.keysLooks++
		}
	}
	t.mu.Unlock()
	if look {
		e.learnJob(t)
	}
	if lookKeys {
		e.learnHostKeys(t)
	}
	return e.info(t), nil
}

// jobLookEvery spaces a task's GETs' looks for its job's final state in
// the runner dir: a file open that was a third of a GET's own work, for
// a state the container's exit reads anyway, and the server polls every
// few seconds. A GET with Cache-Control: no-cache looks at once.
const jobLookEvery = time.Second

// hostKeysLookEvery spaces a running task's GETs' looks for its runner's
// host keys until it wrote them: a file open on every GET was 6% of the
// shim's CPU in a 64-task burst, whose runners start slowly. Each look
// that finds none doubles the spacing, up to hostKeysLookMax: our runner
// writes them once its SSH server listens, milliseconds after it starts,
// and a runner that writes none (dstack's own) is not looked for on every
// poll for the rest of its job. A fresh GET (a client about to pin them)
// looks at once.
const (
	hostKeysLookEvery = 100 * time.Millisecond
	hostKeysLookMax   = 5 * time.Second
)

// keysSpacing is the wait after the looks-th plain look for host keys:
// hostKeysLookEvery (also before the first, which the zero keysLooked
// always passes, and after a fresh look), doubled after each, at most
// hostKeysLookMax.
func keysSpacing(looks int) time.Duration {
	return min(hostKeysLookEvery<<min(max(looks-1, 0), 16), hostKeysLookMax)
}

// lookup finds a task in the table.
func (e *Engine) lookup(id string) (*task, bool) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	t, ok := e.tasks[id]
	return t, ok
}

// List returns all tasks, sorted by id.
func (e *Engine) List() []api.TaskListItem {
	e.mu.RLock()
	defer e.mu.RUnlock()
	out := make([]api.TaskListItem, 0, len(e.tasks))
	for id, t := range e.tasks {
		t.mu.Lock() // lock order: Engine.mu, then task.mu
		out = append(out, api.TaskListItem{ID: id, Status: t.status})
		t.mu.Unlock()
	}
	slices.SortFunc(out, func(a, b api.TaskListItem) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// ImageNames are the images of the tasks not yet terminated: image GC
// keeps them (one pulled and not yet a container has no container to
// protect it).
func (e *Engine) ImageNames() []string {
	e.mu.RLock()
	defer e.mu.RUnlock()
	var out []string
	for _, t := range e.tasks {
		t.mu.Lock() // lock order: Engine.mu, then task.mu
		if t.status != api.TaskTerminated {
			out = append(out, t.cfg.ImageName)
		}
		t.mu.Unlock()
	}
	return out
}

// GPUIDs returns the GPUs a task holds (for metrics filtering).
func (e *Engine) GPUIDs(id string) ([]string, error) {
	t, ok := e.lookup(id)
	if !ok {
		return nil, ErrNotFound
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return slices.Clone(t.held.GPUs), nil
}

// info is what the API answers for t.
func (e *Engine) info(t *task) api.TaskInfoResponse {
	t.mu.Lock()
	defer t.mu.Unlock()
	return e.infoLocked(t)
}

// infoLocked is info with t.mu held.
func (e *Engine) infoLocked(t *task) api.TaskInfoResponse {
	info := api.TaskInfoResponse{
		ID:                 t.cfg.ID,
		Status:             t.status,
		TerminationReason:  t.reason,
		TerminationMessage: t.message,
		Ports:              slices.Clone(t.held.Container.Ports),
		ContainerName:      t.name,
		ContainerID:        t.held.Container.ID,
		GPUIDs:             slices.Clone(t.held.GPUs),
	}
	if t.held.Container.Ports != nil && info.Ports == nil {
		info.Ports = []api.PortMapping{}
	}
	if t.held.GPUs != nil && info.GPUIDs == nil {
		info.GPUIDs = []string{}
	}
	if t.status != api.TaskPending && t.status != api.TaskPreparing {
		info.ImagePullProgress = t.tracker.Progress()
	}
	d := &api.TaskDetails{Name: t.cfg.Name, ImageName: t.cfg.ImageName, NetworkMode: t.cfg.NetworkMode, GPU: t.cfg.GPU, CPU: t.cfg.CPU, Memory: t.cfg.Memory}
	if d.NetworkMode == "" {
		d.NetworkMode = "host"
	}
	if !t.created.IsZero() {
		d.SubmittedAt = t.created.Unix()
	}
	if d.NetworkMode == "host" {
		d.RunnerHTTPPort, d.RunnerSSHPort = e.cfg.RunnerHTTPPort, e.cfg.RunnerSSHPort
	} else {
		for _, p := range t.held.Container.Ports {
			switch p.Container {
			case e.cfg.RunnerHTTPPort:
				d.RunnerHTTPPort = p.Host
			case e.cfg.RunnerSSHPort:
				d.RunnerSSHPort = p.Host
			}
		}
	}
	if t.job != nil {
		j := *t.job
		d.Job = &j
	}
	d.HostKeys = slices.Clone(t.hostKeys)
	if t.status == api.TaskRunning {
		d.Published = slices.Clone(t.held.Container.Published)
	}
	info.Tandem = d
	return info
}
