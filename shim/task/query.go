package task

// Queries: what the API reads.

import (
	"slices"
	"strings"

	"github.com/tandem-run/tandem/api"
)

// Get returns one task.
func (e *Engine) Get(id string) (api.TaskInfoResponse, error) {
	e.mu.RLock()
	t, ok := e.tasks[id]
	if !ok {
		e.mu.RUnlock()
		return api.TaskInfoResponse{}, ErrNotFound
	}
	look := t.job == nil && (t.status == api.TaskRunning || t.status == api.TaskTerminated) && t.contID != ""
	e.mu.RUnlock()
	if look {
		e.learnJob(t)
	}
	e.mu.RLock()
	defer e.mu.RUnlock()
	return e.infoLocked(t), nil
}

// List returns all tasks, sorted by id.
func (e *Engine) List() []api.TaskListItem {
	e.mu.RLock()
	defer e.mu.RUnlock()
	out := make([]api.TaskListItem, 0, len(e.tasks))
	for id, t := range e.tasks {
		out = append(out, api.TaskListItem{ID: id, Status: t.status})
	}
	slices.SortFunc(out, func(a, b api.TaskListItem) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// GPUIDs returns the GPUs a task holds (for metrics filtering).
func (e *Engine) GPUIDs(id string) ([]string, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	t, ok := e.tasks[id]
	if !ok {
		return nil, ErrNotFound
	}
	return slices.Clone(t.gpuIDs), nil
}

func (e *Engine) infoLocked(t *task) api.TaskInfoResponse {
	info := api.TaskInfoResponse{
		ID:                 t.cfg.ID,
		Status:             t.status,
		TerminationReason:  t.reason,
		TerminationMessage: t.message,
		Ports:              slices.Clone(t.ports),
		ContainerName:      t.name,
		ContainerID:        t.contID,
		GPUIDs:             slices.Clone(t.gpuIDs),
	}
	if t.ports != nil && info.Ports == nil {
		info.Ports = []api.PortMapping{}
	}
	if t.gpuIDs != nil && info.GPUIDs == nil {
		info.GPUIDs = []string{}
	}
	if t.status != api.TaskPending && t.status != api.TaskPreparing {
		info.ImagePullProgress = t.tracker.Progress()
	}
	d := &api.TaskDetails{Name: t.cfg.Name, ImageName: t.cfg.ImageName, NetworkMode: t.cfg.NetworkMode, GPU: t.cfg.GPU}
	if d.NetworkMode == "" {
		d.NetworkMode = "host"
	}
	if !t.created.IsZero() {
		d.SubmittedAt = t.created.Unix()
	}
	if d.NetworkMode == "host" {
		d.RunnerHTTPPort, d.RunnerSSHPort = e.cfg.RunnerHTTPPort, e.cfg.RunnerSSHPort
	} else {
		for _, p := range t.ports {
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
	info.Tandem = d
	return info
}
