package ctl

// The task side of a run: the shim, the task's container and its runner
// coming up, and what is left when a run ends early.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/runnerclient"
)

// checkGPUs refuses a run that asks for GPUs the host does not have (all
// of none, or more than it has), as its shim counts them; a shim that does
// not say (dstack's) is left to decide.
func (c *Client) checkGPUs(ctx context.Context, gpus int) error {
	if gpus == 0 {
		return nil
	}
	h, err := c.shim.InstanceHost(ctx)
	if err != nil {
		return nil
	}
	switch {
	case gpus < 0 && h.GPUCount == 0:
		return errors.New("--gpus all: this host has no GPUs its shim can use")
	case gpus > h.GPUCount:
		return fmt.Errorf("--gpus %d: this host has %d GPU(s)", gpus, h.GPUCount)
	}
	return nil
}

// submitTask submits cfg, again while the shim is slow or restarting (a
// repeated submit of the same config is a no-op there).
// The answer is the task as the shim saw it then (ID "" when it says
// nothing of it).
func (c *Client) submitTask(ctx context.Context, cfg api.TaskConfig) (api.TaskInfoResponse, error) {
	info, err := retry(ctx, c.clk, waitPatience, func(ctx context.Context) (api.TaskInfoResponse, error) { return c.shim.Submit(ctx, cfg) })
	if err != nil {
		return info, fmt.Errorf("the shim rejected the task: %w", err)
	}
	return info, nil
}

// hello checks that the shim's address answers as a dstack-shim.
func (c *Client) hello(ctx context.Context) (api.HealthcheckResponse, error) {
	hc, err := c.shim.Healthcheck(ctx)
	if err != nil {
		return hc, ShimUnreached(c.cfg.Shim, err)
	}
	if hc.Service != api.ServiceShim {
		return hc, fmt.Errorf("%s answers as %q, not dstack-shim", c.cfg.Shim, hc.Service)
	}
	return hc, nil
}

// checkRunner refuses, before anything is made, a run on a shim that has
// no runner binary (its component not installed): every task's container
// would fail to be made. A shim that does not say is left to decide.
func (c *Client) checkRunner(ctx context.Context) error {
	comps, err := c.shim.Components(ctx)
	if err != nil {
		return nil
	}
	for _, comp := range comps {
		if comp.Name == api.ComponentRunner && comp.Status == api.ComponentNotInstalled {
			return fmt.Errorf("the shim at %s has no dstack-runner, so no task can start there: start dstack-shim with --runner-binary-path PATH (a build's bin/dstack-runner; make shim does)", c.cfg.Shim)
		}
	}
	return nil
}

// ShimUnreached says why addr did not answer a healthcheck as a shim: no
// answer at all, or an HTTP answer that is not a shim's (a wrong port, a
// proxy on the way), which is no case of "not reachable".
func ShimUnreached(addr string, err error) error {
	if se := (*api.StatusError)(nil); errors.As(err, &se) {
		return fmt.Errorf("the server at %s answered no healthcheck: %w", addr, err)
	}
	var ue *ShimUnreachableError
	if errors.As(err, &ue) {
		return ue
	}
	return &ShimUnreachableError{Addr: addr, Err: err}
}

// taskConfig is the shim task of a run's job.
func taskConfig(o RunOptions, id, name string) api.TaskConfig {
	return api.TaskConfig{ID: id, Name: name, ImageName: o.Image, RegistryUsername: o.RegistryUsername, RegistryPassword: o.RegistryPassword, GPU: o.GPUs, CPU: o.CPU, Memory: o.Memory,
		ShmSize: o.ShmSize, PidsLimit: o.PidsLimit, NetworkMode: o.Network, InstanceMounts: o.Mounts, ContainerSSHKeys: o.SSHKeys, Privileged: o.Privileged, Publish: o.Publish}
}

// taskEnded says why a task ended before its job started: the shim's
// reason and the container's last lines (escaped per line). When its runner
// could not bind the runner's ports on the host network it says who holds
// them, as the shim's task list tells: another host-network task (named),
// or, when none runs, a process that is no task of this shim.
func (c *Client) taskEnded(ctx context.Context, info api.TaskInfoResponse, network string) error {
	err := error(&TaskEndedError{Info: info})
	if network == "bridge" || !strings.Contains(info.TerminationMessage, "address already in use") {
		return err
	}
	holder, known := c.hostPortsHolder(ctx, info.ID)
	switch {
	case !known:
		return withHint(HintBridgeNetwork, fmt.Errorf("%w\nanother host-network task on this shim may hold the runner's ports (tandem ps)", err))
	case holder != "":
		return withHint(HintBridgeNetwork, fmt.Errorf("%w\ntask %s runs on the host network and holds the runner's ports", err, holder))
	}
	return withHint(HintPortsTaken, fmt.Errorf("%w\nno task of this shim holds the runner's ports: another process on this host listens on them", err))
}

// hostPortsHolder names a task of the shim other than self that runs on
// the host network (the runner's ports are then its); known is false when
// the shim's tasks could not be read.
func (c *Client) hostPortsHolder(ctx context.Context, self string) (name string, known bool) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	tasks, err := c.Tasks(ctx)
	if err != nil {
		return "", false
	}
	for _, t := range tasks {
		if t.ID == self || t.Status == api.TaskTerminated {
			continue
		}
		if onHostNetwork(t) {
			return DisplayName(t), true
		}
	}
	return "", true
}

// readyRunner is a client of the task's runner once it answers.
// While it does not, the task is looked at once a second: a task that
// ended (its runner could not start) is that error.
func (c *Client) readyRunner(ctx context.Context, info api.TaskInfoResponse, network string) (*runnerclient.Client, error) {
	r, addr, err := c.runner(info)
	if err != nil {
		return nil, err
	}
	ended := func(ctx context.Context) error {
		if now, err := c.shim.GetTask(ctx, info.ID); err == nil && now.Status == api.TaskTerminated {
			return c.taskEnded(ctx, now, network)
		}
		return nil
	}
	if err := waitRunner(ctx, c.clk, r, info.ID, ended); err != nil {
		var te *TaskEndedError
		if errors.As(err, &te) {
			return nil, err
		}
		return nil, withHint(HintRunnerPort, fmt.Errorf("runner at %s did not answer: %w", addr, err))
	}
	return r, nil
}

// failEarly ends a run before its job ended: when the user interrupted it,
// res says so and the error is ErrInterrupted (what is removed, named by
// removing, is said, kept with keep); otherwise err as it is.
func failEarly(ctx context.Context, s say, keep bool, res *Result, err error, removing string) (Result, error) {
	if !interrupted(ctx) {
		return *res, err
	}
	res.Interrupted, res.State = true, api.JobTerminated
	verb := "removing"
	if keep {
		verb = "stopping"
	}
	s.status("interrupted: %s %s", verb, removing)
	return *res, ErrInterrupted
}

// waitTask polls the task until it runs with its ports known, or ended;
// seen, when not nil, gets each answer on the way; image names the image
// in the pull's progress. first, when it is the task's (the submit's
// answer), is the first answer: a task already running there needs no
// look, which over a long link is a round trip.
func (c *Client) waitTask(ctx context.Context, id, image string, first api.TaskInfoResponse, seen func(api.TaskInfoResponse)) (api.TaskInfoResponse, error) {
	var last api.TaskStatus
	clk := c.clk
	start, phase := clk.Now(), clk.Now()
	for {
		info := first
		first = api.TaskInfoResponse{}
		if info.ID != id {
			var err error
			info, err = retry(ctx, clk, waitPatience, func(ctx context.Context) (api.TaskInfoResponse, error) { return c.shim.GetTask(ctx, id) })
			if err != nil {
				return info, fmt.Errorf("task %s: %w", id, err)
			}
		}
		if seen != nil {
			seen(info)
		}
		if info.Status != last {
			if last != "" {
				c.say.emit(Event{Kind: EventPhaseDone, Task: id[:8], Status: last, Took: clk.Now().Sub(phase)})
			}
			phase, last = clk.Now(), info.Status
		}
		if p := info.ImagePullProgress; p != nil && info.Status == api.TaskPulling && p.TotalBytes > 0 {
			c.say.emit(Event{Kind: EventPull, Task: id[:8], Image: image, Pull: p})
		}
		if info.Status == api.TaskTerminated || (info.Status == api.TaskRunning && info.Ports != nil) {
			c.say.emit(Event{Kind: EventReady, Task: id[:8], Status: info.Status, Took: clk.Now().Sub(start)})
			return info, nil
		}
		select {
		case <-ctx.Done():
			return info, ctx.Err()
		case <-clk.After(taskPace.after(clk.Now().Sub(start))):
		}
	}
}

// How often a run looks while its task and then its runner start: quickly
// at first (a container whose image is here starts in about a tenth of a
// second and its runner answers moments later; a run should not wait out
// a slow pace's step after each), then at a pace for a pull or a slow
// start. A look at a runner not yet listening is a refused connection.
var (
	taskPace   = pace{quick: 15 * time.Millisecond, quickFor: 2 * time.Second, every: 100 * time.Millisecond}
	runnerPace = pace{quick: 5 * time.Millisecond, quickFor: time.Second, every: 50 * time.Millisecond}
)

func waitRunner(ctx context.Context, clk Clock, r *runnerclient.Client, taskID string, ended func(context.Context) error) error {
	clk = clockOr(clk)
	lastLook := clk.Now()
	return pollPaced(ctx, clk, runnerPace, 60*time.Second, func() (bool, error) {
		hc, err := r.Healthcheck(ctx)
		if err == nil && hc.TaskID != "" && hc.TaskID != taskID {
			// The port's previous runner (a task that just ended) is
			// still leaving it: ours comes next.
			err = fmt.Errorf("the runner there serves task %s, not %s", api.Printable(hc.TaskID), taskID)
		}
		if err == nil {
			return true, nil
		}
		if ended != nil && clk.Now().Sub(lastLook) >= time.Second {
			lastLook = clk.Now()
			if eerr := ended(ctx); eerr != nil {
				return true, eerr
			}
		}
		return false, err
	})
}

// ErrNameInUse means a run's --name is a task's of the shim already.
var ErrNameInUse = errors.New("name in use")

// ErrPortsHeld means another task of the shim runs on the host network,
// where a run's runner needs the same ports.
var ErrPortsHeld = errors.New("the runner's ports are held")

// checkShimRoom refuses, before anything is made, a run the shim's tasks
// leave no room for:
//   - a name given to a run that a task of the shim has, as docker refuses
//     a container name in use until that container is removed: tandem
//     stop NAME, attach NAME and the ssh config's Host entry each want one
//     task per name. A run's own name (tandem-<id>) is not looked up: it
//     is new.
//   - a host-network run while another task of the shim runs on the host
//     network and its job has not ended: its runner holds the runner's
//     ports, and the new task's runner would wait for them (3 s) and fail.
//     A task whose job ended is no obstacle: its runner is leaving. A
//     holder is looked at again for up to holderGrace before the refusal:
//     a run -d of a short job returns as its job starts, and a second
//     run -d right after it should find that job ended, not be refused
//     for the few milliseconds it still ran.
func (c *Client) checkShimRoom(ctx context.Context, name, network string) error {
	hostNet := network == "" || network == "host"
	if name == "" && !hostNet {
		return nil
	}
	tasks, err := c.Tasks(ctx)
	if err != nil {
		return err
	}
	for _, t := range tasks {
		if name != "" && TaskName(t) == name {
			return fmt.Errorf("%w: task %s is named %q (%s): remove it (tandem rm %s) or give another --name",
				ErrNameInUse, ShortID(t.ID), name, t.Status, ShortID(t.ID))
		}
	}
	if !hostNet {
		return nil
	}
	var holders []api.TaskInfoResponse
	for _, t := range tasks {
		if holdsRunnerPorts(t) {
			holders = append(holders, t)
		}
	}
	if len(holders) == 0 {
		return nil
	}
	var holder api.TaskInfoResponse
	_ = pollPaced(ctx, c.clk, taskPace, holderGrace, func() (bool, error) {
		kept := holders[:0]
		for _, t := range holders {
			info, err := c.shim.GetTask(ctx, t.ID)
			switch {
			case errors.Is(err, api.ErrNotFound):
				continue // removed: no longer holds anything
			case err == nil:
				t = info
			}
			if holdsRunnerPorts(t) {
				kept = append(kept, t)
			}
		}
		holders = kept
		if len(holders) > 0 {
			holder = holders[0]
		}
		return len(holders) == 0, nil
	})
	if len(holders) == 0 {
		return nil
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	return withHint(HintBridgeNetwork, fmt.Errorf("%w: task %s runs on the host network (%s), and a host-network run's runner needs the same ports",
		ErrPortsHeld, DisplayName(holder), holder.Status))
}

// holderGrace is how long a run looks again at a host-network task that
// holds the runner's ports before it is refused for it.
const holderGrace = time.Second

// holdsRunnerPorts says whether t's runner holds the host's runner ports:
// t runs on the host network, is not terminated and its job has not ended.
func holdsRunnerPorts(t api.TaskInfoResponse) bool {
	return t.Status != api.TaskTerminated && onHostNetwork(t) && !JobEnded(t)
}

// onHostNetwork says whether a task runs on the host network (a shim that
// does not say, dstack's, runs its tasks there).
func onHostNetwork(t api.TaskInfoResponse) bool {
	return t.Tandem == nil || t.Tandem.NetworkMode == "" || t.Tandem.NetworkMode == "host"
}
