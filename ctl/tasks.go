package ctl

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/runnerclient"
)

// Tasks returns every task of the shim with its details, in the shim's
// order. A task removed between the list and its read is left out.
func (c *Client) Tasks(ctx context.Context) ([]api.TaskInfoResponse, error) {
	items, err := c.shim.ListTasks(ctx)
	if err != nil {
		return nil, fmt.Errorf("list tasks: %w", err)
	}
	out := make([]api.TaskInfoResponse, len(items))
	ok := make([]bool, len(items))
	errs := make([]error, len(items))
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for i, it := range items {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			info, err := retry(ctx, c.clk, 20*time.Second, func(ctx context.Context) (api.TaskInfoResponse, error) { return c.shim.GetTask(ctx, it.ID) })
			switch {
			case errors.Is(err, api.ErrNotFound):
			case err != nil:
				errs[i] = err
			default:
				out[i], ok[i] = info, true
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("read tasks: %w", err)
	}
	var res []api.TaskInfoResponse
	for i := range out {
		if ok[i] {
			res = append(res, out[i])
		}
	}
	return res, nil
}

// ErrNoTask means a reference matched no task.
var ErrNoTask = errors.New("no such task")

// Match picks the task ref names among tasks, as docker does: an exact id,
// then an exact name, then a unique id prefix. A name that more than one
// task has (dstack's server reuses a job's name; another client may too)
// or an ambiguous prefix is an error naming the candidates: a stop or rm
// never picks one of them.
func Match(tasks []api.TaskInfoResponse, ref string) (api.TaskInfoResponse, error) {
	if ref == "" {
		return api.TaskInfoResponse{}, errors.New("empty task reference")
	}
	for _, t := range tasks {
		if t.ID == ref {
			return t, nil
		}
	}
	var named []api.TaskInfoResponse
	for _, t := range tasks {
		if n := TaskName(t); n != "" && n == ref {
			named = append(named, t)
		}
	}
	switch len(named) {
	case 1:
		return named[0], nil
	case 0:
	default:
		return api.TaskInfoResponse{}, fmt.Errorf("%d tasks are named %q (%s): give the id", len(named), ref, idsOf(named))
	}
	var hits []api.TaskInfoResponse
	for _, t := range tasks {
		if strings.HasPrefix(t.ID, ref) {
			hits = append(hits, t)
		}
	}
	switch len(hits) {
	case 0:
		return api.TaskInfoResponse{}, fmt.Errorf("%w: %q (tandem ps -a lists them)", ErrNoTask, ref)
	case 1:
		return hits[0], nil
	}
	return api.TaskInfoResponse{}, fmt.Errorf("%q matches %d tasks (%s): give more of the id", ref, len(hits), idsOf(hits))
}

// idsOf lists the tasks' ids, sorted.
func idsOf(tasks []api.TaskInfoResponse) string {
	ids := make([]string, 0, len(tasks))
	for _, t := range tasks {
		ids = append(ids, t.ID)
	}
	slices.Sort(ids)
	return strings.Join(ids, ", ")
}

// Resolve finds the task ref names on the shim (see Match).
func (c *Client) Resolve(ctx context.Context, ref string) (api.TaskInfoResponse, error) {
	if info, err := c.shim.GetTask(ctx, ref); err == nil { // a full id: one call
		return info, nil
	}
	tasks, err := c.Tasks(ctx)
	if err != nil {
		return api.TaskInfoResponse{}, err
	}
	return Match(tasks, ref)
}

// Remove removes a finished task (terminated, or its job ended), or with
// force a running one, stopped at once first (docker rm -f). A running
// task without force is refused: a stop keeps it (StopTask), a remove
// loses its output and exit status, so it is never done by default.
func (c *Client) Remove(ctx context.Context, info api.TaskInfoResponse, force bool, timeout uint) error {
	if info.Status != api.TaskTerminated && !JobEnded(info) {
		if !force {
			return withHint(HintRemoveRunning, fmt.Errorf("task %s is %s", DisplayName(info), info.Status))
		}
	}
	if err := c.cleanup(ctx, info.ID, timeout, false); err != nil {
		return fmt.Errorf("%s %s", DisplayName(info), err)
	}
	return nil
}

// StopTask stops a task's job (timeout seconds of grace, then a kill) and
// keeps the task, as docker stop keeps a container: its output, its exit
// status and its ps -a row stay until Remove. A task already stopped is
// fine.
func (c *Client) StopTask(ctx context.Context, info api.TaskInfoResponse, timeout uint) error {
	if info.Status == api.TaskTerminated {
		return nil
	}
	if err := c.terminate(ctx, info.ID, timeout); err != nil {
		return fmt.Errorf("%s %s", DisplayName(info), err)
	}
	return nil
}

// JobStatus asks a running task's runner how its job stands (the last job
// state), within a short bound; ok is false when the runner does not say.
func (c *Client) JobStatus(ctx context.Context, info api.TaskInfoResponse) (api.JobStateEvent, bool) {
	if info.Status != api.TaskRunning {
		return api.JobStateEvent{}, false
	}
	r, _, err := c.runner(info)
	if err != nil {
		return api.JobStateEvent{}, false
	}
	return lastJobState(ctx, r)
}

// lastJobState peeks at the runner's last job state (it stays for the
// next pull), within a short bound.
func lastJobState(ctx context.Context, r *runnerclient.Client) (api.JobStateEvent, bool) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	p, err := r.Peek(ctx, 0)
	if err != nil || len(p.JobStates) == 0 {
		return api.JobStateEvent{}, false
	}
	return p.JobStates[len(p.JobStates)-1], true
}

// runnerOf resolves ref and returns the task and a client of its runner.
func (c *Client) runnerOf(ctx context.Context, ref string, what string) (api.TaskInfoResponse, *runnerclient.Client, string, error) {
	info, err := c.Resolve(ctx, ref)
	if err != nil {
		return info, nil, "", err
	}
	if info.Status != api.TaskRunning {
		msg := fmt.Sprintf("task %s is %s", DisplayName(info), info.Status)
		if info.Status == api.TaskTerminated {
			msg += fmt.Sprintf(" (%s)", info.TerminationReason)
		}
		return info, nil, "", fmt.Errorf("%s; %s needs a running task", msg, what)
	}
	r, addr, err := c.runner(info)
	return info, r, addr, err
}

// cleanup terminates and removes a task, retrying transient failures for
// cleanupPatience; a task already gone is fine.
//
// With behind (a Tandem shim), the remove is sent right behind the
// terminate, not after its answer (a round trip saved over a long link):
// that shim serves a task's calls one at a time, so it removes the task
// once the stop ended, and a remove that got there first is refused (the
// task still ran) and asked again once the terminate answered. dstack's
// shim exits (log.Fatal "already locked!") when a task's terminate and
// remove overlap: it is asked one call after the other.
func (c *Client) cleanup(ctx context.Context, id string, timeout uint, behind bool) error {
	var early chan error
	if behind {
		early = make(chan error, 1)
		go func() {
			t := time.NewTimer(removeBehind) // real time: an order, not a wait
			defer t.Stop()
			select {
			case <-t.C:
				early <- c.shim.RemoveTask(ctx, id)
			case <-ctx.Done():
				early <- ctx.Err()
			}
		}()
	}
	_, err := retry(ctx, c.clk, cleanupPatience, func(ctx context.Context) (api.TaskInfoResponse, error) {
		return c.shim.TerminateTask(ctx, id, api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser, Timeout: timeout})
	})
	removedEarly := false
	if early != nil {
		removed := <-early
		removedEarly = removed == nil || errors.Is(removed, api.ErrNotFound)
	}
	if err != nil && !errors.Is(err, api.ErrNotFound) {
		return fmt.Errorf("terminate: %w", err)
	}
	if removedEarly {
		return nil
	}
	_, err = retry(ctx, c.clk, cleanupPatience, func(ctx context.Context) (struct{}, error) { return struct{}{}, c.shim.RemoveTask(ctx, id) })
	if err != nil && !errors.Is(err, api.ErrNotFound) {
		return fmt.Errorf("remove: %w", err)
	}
	return nil
}

// terminate stops a task and keeps it, retrying transient failures for
// cleanupPatience; a task already gone is fine.
func (c *Client) terminate(ctx context.Context, id string, timeout uint) error {
	_, err := retry(ctx, c.clk, cleanupPatience, func(ctx context.Context) (api.TaskInfoResponse, error) {
		return c.shim.TerminateTask(ctx, id, api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser, Timeout: timeout})
	})
	if err != nil && !errors.Is(err, api.ErrNotFound) {
		return fmt.Errorf("terminate: %w", err)
	}
	return nil
}

// removeBehind is how long after the terminate the remove is sent: enough
// for the terminate to reach the shim first when both leave together.
const removeBehind = 2 * time.Millisecond
