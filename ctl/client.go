package ctl

// The one client: how a command reaches a shim and its tasks' runners.

import (
	"cmp"
	"context"
	"fmt"
	"net"
	"strconv"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/runnerclient"
	"github.com/tandem-run/tandem/api/shimclient"
)

// Config is how a command reaches one shim and the runners of its tasks,
// set once per command, as Nomad's api.Config is: every verb of the
// Client made from it reads the same address, token, dialer, ports, SSH
// route, clock and progress.
type Config struct {
	Shim      string // the shim's address, host:port (as seen from the far end with Dial)
	ShimToken string // bearer token for a shim started with --api-token
	// Dial, when set, opens every agent connection (e.g. a Tunnel's Dial);
	// the shim's and the runners' addresses are then as seen from the far
	// end. nil: direct.
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
	// Ports are where the tasks' runners answer on the shim's host
	// (overrides; 0: as the shim reports).
	Ports Ports
	// SSH is the host reached over SSH, when it is (the tunnel behind
	// Dial): OpenSSH's jump host to a task's SSH server, with its key and
	// known_hosts. Its zero: the shim's host is reached directly.
	SSH SSHTarget
	// Progress receives what a verb has to say while it works (progress.go);
	// nil: nothing is said. The library writes to no stream of its own.
	Progress func(Event)
	// Clock is what waits run on (nil: the real one).
	Clock Clock
}

// Client speaks to one shim, and to the runners of its tasks, as its
// Config says. Its verbs (Tasks, Logs, Attach, Wait, SSHCommand, NewRun
// ...) share its shim connection; it is safe for concurrent use.
type Client struct {
	cfg  Config
	clk  Clock
	say  say
	shim *shimclient.Client
}

// NewClient returns the client cfg describes; nothing is dialed yet.
func NewClient(cfg Config) (*Client, error) {
	shim, err := shimclient.NewWithDialer(cfg.Shim, unreachableAs(cfg.Shim, cfg.Dial))
	if err != nil {
		return nil, err
	}
	shim.SetToken(cfg.ShimToken)
	shim.SetFresh(true) // rm and attach act on the job's end as soon as it is written
	return &Client{cfg: cfg, clk: clockOr(cfg.Clock), say: cfg.Progress, shim: shim}, nil
}

// Config is the config the client was made with.
func (c *Client) Config() Config { return c.cfg }

// Shim is the client of the shim itself, for what no verb here asks
// (tandem info).
func (c *Client) Shim() *shimclient.Client { return c.shim }

// at is a client of the shim at addr, reached with dial, with the rest of
// c's config (a multi-node run's node).
func (c *Client) at(addr string, dial func(ctx context.Context, network, addr string) (net.Conn, error)) (*Client, error) {
	cfg := c.cfg
	cfg.Shim, cfg.Dial, cfg.Progress = addr, dial, c.say
	return NewClient(cfg)
}

// runner returns a client of the task's runner on the shim's host, and
// its address. It names the task in every call: a runner that serves
// another task refuses.
func (c *Client) runner(info api.TaskInfoResponse) (*runnerclient.Client, string, error) {
	addr, err := runnerAddr(c.cfg.Shim, info, c.cfg.Ports.HTTP)
	if err != nil {
		return nil, "", err
	}
	r, err := runnerclient.NewWithDialer(addr, c.cfg.Dial)
	if err != nil {
		return nil, addr, err
	}
	r.ForTask(info.ID)
	return r, addr, nil
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

// SSHTarget is how to reach a machine over SSH, as the dstack server does:
// a login on the host, tunnelling to the agents' local ports there.
type SSHTarget struct {
	Target     string // user@host[:port]
	Identity   string // private key file ("" = ~/.ssh/id_ed25519, then id_rsa)
	KnownHosts string // known_hosts file ("" = ~/.ssh/known_hosts)
}
