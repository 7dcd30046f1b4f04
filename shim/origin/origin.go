// Package origin tells whether a TCP connection to the shim comes from the
// host itself or from inside a container. A job in host network mode shares
// the host's loopback, so the address cannot tell: the process that owns
// the client's socket can. Its mount namespace is the host's for sshd (the
// dstack server's tunnel), tandem and anything else running on the host,
// and a container's own for every job.
package origin

import (
	"errors"
	"fmt"
	"net"
)

// Verdict is the answer for one connection.
type Verdict struct {
	FromHost bool
	// Peer describes the client for logs and refusals: address, and the
	// owning process when found ("127.0.0.1:41234 pid 812 (sh)").
	Peer string
	// Reason says why a connection is not from the host.
	Reason string
}

// ErrNotFound means the client's socket is not in this network namespace's
// tables (a client on another machine, or in another network namespace).
var ErrNotFound = errors.New("client socket not found on this host")

// Checker resolves connections. Proc is the procfs root ("/proc").
type Checker struct {
	Proc string
}

func (c Checker) proc() string {
	if c.Proc == "" {
		return "/proc"
	}
	return c.Proc
}

// Check resolves the connection between local (the shim's end) and remote
// (the client's end).
func (c Checker) Check(local, remote net.Addr) Verdict {
	l, ok1 := local.(*net.TCPAddr)
	r, ok2 := remote.(*net.TCPAddr)
	if !ok1 || !ok2 {
		return Verdict{Peer: remote.String(), Reason: "not a TCP connection"}
	}
	v := Verdict{Peer: r.String()}
	inode, err := c.socketInode(l, r)
	if err != nil {
		v.Reason = err.Error()
		return v
	}
	pid, comm, err := c.socketOwner(inode)
	if err != nil {
		v.Reason = err.Error()
		return v
	}
	v.Peer = fmt.Sprintf("%s pid %d (%s)", r, pid, comm)
	same, err := c.sameMountNamespace(pid)
	switch {
	case err != nil:
		v.Reason = err.Error()
	case !same:
		v.Reason = "the client runs in another mount namespace (a container)"
	default:
		v.FromHost = true
	}
	return v
}
