package ctl

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/tandem-run/tandem/api"
)

// DefaultPublicKey returns the user's public key line (~/.ssh/id_ed25519.pub
// or id_rsa.pub), or "" when there is none.
func DefaultPublicKey(identity string) string {
	var files []string
	if identity != "" {
		files = []string{identity + ".pub"}
	} else if home, err := os.UserHomeDir(); err == nil {
		files = []string{filepath.Join(home, ".ssh", "id_ed25519.pub"), filepath.Join(home, ".ssh", "id_rsa.pub")}
	}
	for _, f := range files {
		if b, err := os.ReadFile(f); err == nil {
			return strings.TrimSpace(string(b))
		}
	}
	return ""
}

// SSHOptions locate a task's SSH server.
type SSHOptions struct {
	Shim          string
	ShimToken     string // bearer token for a shim started with --api-token
	RunnerSSHPort int    // the shim's --runner-ssh-port (host network)
	Jump          string // user@host[:port] when the host is reached over SSH
	Identity      string
	User          string // login in the container (default root)
	Dial          func(ctx context.Context, network, addr string) (net.Conn, error)
}

// SSHCommand returns the OpenSSH client argv that opens a shell (or runs
// command) in the task's container through the runner's SSH server.
func SSHCommand(ctx context.Context, task string, o SSHOptions, command []string) ([]string, error) {
	shim, err := newShimClient(o.Shim, o.Dial, o.ShimToken)
	if err != nil {
		return nil, err
	}
	info, err := shim.GetTask(ctx, task)
	if errors.Is(err, api.ErrNotFound) {
		return nil, fmt.Errorf("no task %s on the shim at %s", task, o.Shim)
	}
	if err != nil {
		return nil, err
	}
	if info.Status != api.TaskRunning {
		return nil, fmt.Errorf("task %s is %s; ssh needs a running task", task, info.Status)
	}
	host, _, err := net.SplitHostPort(o.Shim)
	if err != nil {
		return nil, fmt.Errorf("shim address %q: %w", o.Shim, err)
	}
	port := o.RunnerSSHPort
	for _, p := range info.Ports { // bridge mode: the published port
		if p.Container == o.RunnerSSHPort {
			port = p.Host
		}
	}
	user := o.User
	if user == "" {
		user = "root"
	}
	argv := []string{"ssh", "-p", strconv.Itoa(port),
		// The container's host key is created per task: pinning it buys
		// nothing, and the path to it is already authenticated (local, or
		// through the checked jump host).
		"-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"}
	if o.Identity != "" {
		argv = append(argv, "-i", o.Identity, "-o", "IdentitiesOnly=yes")
	}
	if o.Jump != "" {
		argv = append(argv, "-J", o.Jump)
	}
	argv = append(argv, user+"@"+host)
	return append(argv, command...), nil
}
