package ctl

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/runnerclient"
	"github.com/tandem-run/tandem/api/shimclient"
)

// LogsOptions select a task's output.
type LogsOptions struct {
	Shim       string
	ShimToken  string // bearer token for a shim started with --api-token
	RunnerPort int
	Network    string // how the task was started: host or bridge
	Since      time.Time
	Dial       func(ctx context.Context, network, addr string) (net.Conn, error)
}

// Logs streams a running task's raw output from its runner to w until the
// job's output ends.
func Logs(ctx context.Context, task string, o LogsOptions, w io.Writer) error {
	shim, err := newShimClient(o.Shim, o.Dial, o.ShimToken)
	if err != nil {
		return err
	}
	info, err := shim.GetTask(ctx, task)
	if errors.Is(err, api.ErrNotFound) {
		return fmt.Errorf("no task %s on the shim at %s", task, o.Shim)
	}
	if err != nil {
		return err
	}
	if info.Status != api.TaskRunning {
		return fmt.Errorf("task %s is %s; its runner serves logs only while running", task, info.Status)
	}
	ro := RunOptions{Shim: o.Shim, RunnerPort: o.RunnerPort, Network: o.Network}
	if len(info.Ports) > 0 {
		ro.Network = "bridge"
	}
	addr, err := runnerAddress(ro, info)
	if err != nil {
		return err
	}
	r, err := runnerclient.NewWithDialer(addr, o.Dial)
	if err != nil {
		return err
	}
	ls, err := r.Logs(ctx, o.Since)
	if err != nil {
		return fmt.Errorf("runner of task %s at %s: %w", task, addr, err)
	}
	defer ls.Close()
	for {
		b, err := ls.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if _, err := w.Write(b); err != nil {
			return err
		}
	}
}

// newShimClient is the shim client every command uses.
func newShimClient(addr string, dial func(ctx context.Context, network, addr string) (net.Conn, error), token string) (*shimclient.Client, error) {
	c, err := shimclient.NewWithDialer(addr, dial)
	if err != nil {
		return nil, err
	}
	c.SetToken(token)
	return c, nil
}
