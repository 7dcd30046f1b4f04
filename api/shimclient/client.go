// Package shimclient is the typed client of dstack-shim's HTTP API (tasks API
// v2), as the dstack server and the tandem CLI use it.
package shimclient

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/internal/transport"
)

// Client talks to one shim.
type Client struct {
	t     *transport.Client
	fresh bool // GetTask sends Cache-Control: no-cache
}

// New returns a client for addr: "host:port", "http://host:port" or
// "unix:///path.sock".
func New(addr string) (*Client, error) {
	return NewWithDialer(addr, nil)
}

// NewWithDialer is New with connections opened by dial, e.g. through an SSH
// tunnel (addr is then as seen from the far end).
func NewWithDialer(addr string, dial transport.DialFunc) (*Client, error) {
	t, err := transport.NewWithDialer(addr, dial)
	if err != nil {
		return nil, fmt.Errorf("shim client: %w", err)
	}
	return &Client{t: t}, nil
}

// BaseURL is the http:// URL the client talks to.
func (c *Client) BaseURL() string { return c.t.BaseURL }

// SetToken sends token as a bearer token on every call (a shim started
// with --api-token).
func (c *Client) SetToken(token string) { c.t.Token = token }

// SetFresh makes GetTask ask for a fresh answer (Cache-Control: no-cache):
// the shim looks for the job's final state (Tandem's extension) now,
// where a plain GET's view of it may be up to a second old. For clients
// that act on that state; pollers, like dstack's server, leave it off.
func (c *Client) SetFresh(on bool) { c.fresh = on }

// SetTimeout changes the per-call timeout (default 9 s, as the server's).
func (c *Client) SetTimeout(d time.Duration) { c.t.Timeout = d }

// Healthcheck pings the shim and returns its service name and version.
func (c *Client) Healthcheck(ctx context.Context) (api.HealthcheckResponse, error) {
	var out api.HealthcheckResponse
	err := c.t.JSON(ctx, transport.Request{Method: http.MethodGet, Path: "/api/healthcheck"}, &out)
	return out, err
}

// Shutdown asks the shim to exit (its supervisor restarts it).
func (c *Client) Shutdown(ctx context.Context, force bool) error {
	return c.t.JSON(ctx, transport.Request{Method: http.MethodPost, Path: "/api/shutdown", JSON: api.ShutdownRequest{Force: force}}, nil)
}

// InstanceHealth returns the DCGM health (null when not available).
func (c *Client) InstanceHealth(ctx context.Context) (api.InstanceHealthResponse, error) {
	var out api.InstanceHealthResponse
	err := c.t.JSON(ctx, transport.Request{Method: http.MethodGet, Path: "/api/instance/health"}, &out)
	return out, err
}

// InstanceInfo returns the GPU vendor and driver version.
func (c *Client) InstanceInfo(ctx context.Context) (api.InstanceInfoResponse, error) {
	var out api.InstanceInfoResponse
	err := c.t.JSON(ctx, transport.Request{Method: http.MethodGet, Path: "/api/instance/info"}, &out)
	return out, err
}

// InstanceAddresses returns the host's name and addresses (Tandem's shim
// only: dstack's answers 404).
func (c *Client) InstanceHost(ctx context.Context) (api.InstanceHostResponse, error) {
	var out api.InstanceHostResponse
	err := c.t.JSON(ctx, transport.Request{Method: http.MethodGet, Path: "/api/instance/host"}, &out)
	return out, err
}

// Components lists the runner and shim binaries and their install status.
func (c *Client) Components(ctx context.Context) ([]api.ComponentInfo, error) {
	var out api.ComponentListResponse
	err := c.t.JSON(ctx, transport.Request{Method: http.MethodGet, Path: "/api/components"}, &out)
	return out.Components, err
}

// InstallComponent starts a background install of a component from url.
func (c *Client) InstallComponent(ctx context.Context, name api.ComponentName, url string) error {
	return c.t.JSON(ctx, transport.Request{Method: http.MethodPost, Path: "/api/components/install",
		JSON: api.ComponentInstallRequest{Name: name, URL: url}}, nil)
}

// ListTasks lists all tasks, terminated ones included. Answers of old shims
// ({"ids": [...]}) come back as items with an empty status.
func (c *Client) ListTasks(ctx context.Context) ([]api.TaskListItem, error) {
	var out api.TaskListResponse
	if err := c.t.JSON(ctx, transport.Request{Method: http.MethodGet, Path: "/api/tasks"}, &out); err != nil {
		return nil, err
	}
	if out.Tasks == nil && out.IDs != nil {
		items := make([]api.TaskListItem, 0, len(out.IDs))
		for _, id := range out.IDs {
			items = append(items, api.TaskListItem{ID: id})
		}
		return items, nil
	}
	if out.Tasks == nil {
		out.Tasks = []api.TaskListItem{}
	}
	return out.Tasks, nil
}

// SubmitTask submits and starts a task. A task with the same id → ErrConflict.
func (c *Client) SubmitTask(ctx context.Context, cfg api.TaskConfig) error {
	_, err := c.Submit(ctx, cfg)
	return err
}

// Submit is SubmitTask with the shim's answer: the task as it was when
// the shim answered (a Tandem shim answers once the task runs, its runner
// ports in Tandem; dstack's at once, pending). The task was accepted
// whatever the answer's body: one that is not a task (an older shim's)
// is the zero info, its ID "", never an error.
func (c *Client) Submit(ctx context.Context, cfg api.TaskConfig) (api.TaskInfoResponse, error) {
	resp, cancel, err := c.t.Do(ctx, transport.Request{Method: http.MethodPost, Path: "/api/tasks", JSON: cfg})
	if err != nil {
		return api.TaskInfoResponse{}, err
	}
	defer cancel()
	defer resp.Body.Close()
	var out api.TaskSubmitResponse
	if b, err := io.ReadAll(io.LimitReader(resp.Body, transport.MaxAnswer)); err != nil || json.Unmarshal(b, &out) != nil || out.ID != cfg.ID {
		return api.TaskInfoResponse{}, nil
	}
	return out.Info(), nil
}

// GetTask returns one task; unknown → ErrNotFound.
func (c *Client) GetTask(ctx context.Context, id string) (api.TaskInfoResponse, error) {
	var out api.TaskInfoResponse
	req := transport.Request{Method: http.MethodGet, Path: taskPath(id, "")}
	if c.fresh {
		req.Header = http.Header{"Cache-Control": {"no-cache"}}
	}
	err := c.t.JSON(ctx, req, &out)
	return out, err
}

// TerminateTask stops a task, giving it req.Timeout seconds. The call blocks
// for that long, so the per-call timeout is extended accordingly.
func (c *Client) TerminateTask(ctx context.Context, id string, req api.TaskTerminateRequest) (api.TaskInfoResponse, error) {
	var out api.TaskInfoResponse
	base := c.t.Timeout
	if base == 0 {
		base = transport.DefaultTimeout
	}
	timeout := base + time.Duration(req.Timeout)*time.Second
	err := c.t.JSON(ctx, transport.Request{Method: http.MethodPost, Path: taskPath(id, "/terminate"), JSON: req, Timeout: timeout}, &out)
	return out, err
}

// RemoveTask forgets a terminated task and removes its container.
func (c *Client) RemoveTask(ctx context.Context, id string) error {
	return c.t.JSON(ctx, transport.Request{Method: http.MethodPost, Path: taskPath(id, "/remove")}, nil)
}

// TaskMetrics returns the Prometheus text of the task's GPUs.
func (c *Client) TaskMetrics(ctx context.Context, id string) (string, error) {
	resp, cancel, err := c.t.Do(ctx, transport.Request{Method: http.MethodGet, Path: "/metrics/tasks/" + url.PathEscape(id)})
	if err != nil {
		return "", err
	}
	defer cancel()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", fmt.Errorf("read task metrics: %w", err)
	}
	return string(b), nil
}

// JobLog copies the raw output the task's runner kept into w (Tandem's
// shim only: also after the runner and its container are gone).
func (c *Client) JobLog(ctx context.Context, id string, w io.Writer) error {
	resp, cancel, err := c.t.Do(ctx, transport.Request{Method: http.MethodGet, Path: taskPath(id, "/job-log"), Timeout: 5 * time.Minute})
	if err != nil {
		return err
	}
	defer cancel()
	defer resp.Body.Close()
	if _, err := io.Copy(w, resp.Body); err != nil {
		return fmt.Errorf("read job log: %w", err)
	}
	return nil
}

// TaskImageConfig returns the config of the image the task's container
// was made from (Tandem's shim only: dstack's answers 404). A task whose
// container is not made yet is api.ErrConflict.
func (c *Client) TaskImageConfig(ctx context.Context, id string) (api.TaskImageConfig, error) {
	var out api.TaskImageConfig
	err := c.t.JSON(ctx, transport.Request{Method: http.MethodGet, Path: taskPath(id, "/image-config")}, &out)
	return out, err
}

func taskPath(id, suffix string) string {
	return "/api/tasks/" + url.PathEscape(id) + suffix
}
