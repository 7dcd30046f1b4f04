package ctl

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/runnerclient"
	"github.com/tandem-run/tandem/api/shimclient"
)

// Tasks returns every task of the shim with its details, in the shim's
// order. A task removed between the list and its read is left out.
func Tasks(ctx context.Context, shim *shimclient.Client) ([]api.TaskInfoResponse, error) {
	items, err := shim.ListTasks(ctx)
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
			info, err := retry(ctx, nil, 20*time.Second, func(ctx context.Context) (api.TaskInfoResponse, error) { return shim.GetTask(ctx, it.ID) })
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
func Resolve(ctx context.Context, shim *shimclient.Client, ref string) (api.TaskInfoResponse, error) {
	if info, err := shim.GetTask(ctx, ref); err == nil { // a full id: one call
		return info, nil
	}
	tasks, err := Tasks(ctx, shim)
	if err != nil {
		return api.TaskInfoResponse{}, err
	}
	return Match(tasks, ref)
}

// reportedPorts are where the task's runner answers as the shim says: its
// task details, or for a shim without details (dstack's) the dstack
// defaults, or the published mappings in bridge mode. 0: not known yet.
func reportedPorts(info api.TaskInfoResponse) Ports {
	if d := info.Tandem; d != nil {
		return Ports{HTTP: d.RunnerHTTPPort, SSH: d.RunnerSSHPort}
	}
	p := Ports{HTTP: api.RunnerHTTPPort, SSH: api.RunnerSSHPort}
	for _, m := range info.Ports {
		switch m.Container {
		case api.RunnerHTTPPort:
			p.HTTP = m.Host
		case api.RunnerSSHPort:
			p.SSH = m.Host
		}
	}
	return p
}

// RunnerHTTPPort is where the task's runner serves its API: override (the
// user's) first, then what the shim reports. The error hints at the port.
func RunnerHTTPPort(info api.TaskInfoResponse, override int) (int, error) {
	return runnerPort(info, override, reportedPorts(info).HTTP, HintRunnerPort)
}

// RunnerSSHPort is where the task's runner serves SSH (see RunnerHTTPPort).
func RunnerSSHPort(info api.TaskInfoResponse, override int) (int, error) {
	return runnerPort(info, override, reportedPorts(info).SSH, HintRunnerSSHPort)
}

func runnerPort(info api.TaskInfoResponse, override, reported int, hint Hint) (int, error) {
	if port := cmp.Or(override, reported); port != 0 {
		return port, nil
	}
	return 0, withHint(hint, fmt.Errorf("the shim reports no runner port for task %s yet (status %s)", ShortID(info.ID), info.Status))
}

// runnerFor returns a client of the task's runner on the shim's host, and
// its address.
func runnerFor(shim string, info api.TaskInfoResponse, override int, dial func(context.Context, string, string) (net.Conn, error)) (*runnerclient.Client, string, error) {
	addr, err := runnerAddr(shim, info, override)
	if err != nil {
		return nil, "", err
	}
	r, err := runnerclient.NewWithDialer(addr, dial)
	if err == nil {
		r.ForTask(info.ID) // a runner that serves another task refuses
	}
	return r, addr, err
}

// runnerAddr is where the task's runner answers: the shim's host, the
// runner's HTTP port.
func runnerAddr(shim string, info api.TaskInfoResponse, override int) (string, error) {
	host, err := hostOf(shim)
	if err != nil {
		return "", err
	}
	port, err := RunnerHTTPPort(info, override)
	if err != nil {
		return "", err
	}
	return joinPort(host, port), nil
}

// hostOf is the host part of the shim's address: the runner is on the same
// machine.
func hostOf(shim string) (string, error) {
	host, _, err := net.SplitHostPort(shim)
	if err != nil {
		return "", fmt.Errorf("shim address %q: %w", shim, err)
	}
	return host, nil
}

func joinPort(host string, port int) string { return net.JoinHostPort(host, strconv.Itoa(port)) }
