// Package origin tells whether a TCP connection to the shim comes from the
// host itself or from inside a container. A job in host network mode shares
// the host's loopback, so the address cannot tell: the process that owns
// the client's socket can. Its mount namespace is the host's for sshd (the
// dstack server's tunnel), tandem and anything else running on the host,
// and a container's own for every job.
package origin

import (
	"fmt"
	"net"
	"strconv"

	"github.com/tandem-run/tandem/common/sockdiag"
)

// Verdict is the answer for one connection.
type Verdict struct {
	FromHost bool
	// Peer describes the client for logs and refusals: address, and the
	// owning process when found ("127.0.0.1:41234 pid 812 (sh)").
	Peer string
	// Reason says why a connection is not from the host.
	Reason string
	// Client identifies the process that owns the client's socket
	// ("pid 812"), for fairness between clients; "" when not found.
	Client string
	// UID owns the client's socket (the kernel's record of who made it);
	// valid when HasUID.
	UID    uint32
	HasUID bool
}

// ErrNotFound means the client's socket is not in this network namespace's
// tables (a client on another machine, or in another network namespace).
var ErrNotFound = sockdiag.ErrNotFound

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

// Pair is one connection: the shim's end and the client's.
type Pair struct{ Local, Remote net.Addr }

// Check resolves the connection between local (the shim's end) and remote
// (the client's end).
func (c Checker) Check(local, remote net.Addr) Verdict {
	return c.CheckBatch([]Pair{{Local: local, Remote: remote}})[0]
}

// CheckBatch resolves many connections with one walk of the process table:
// finding who owns a socket costs a read of every descriptor link of the
// processes walked, so a flood of connections is decided for the price of
// a few walks, not one walk each.
func (c Checker) CheckBatch(pairs []Pair) []Verdict {
	out := make([]Verdict, len(pairs))
	inodes := make([]uint64, len(pairs))
	want := map[uint64]struct{}{}
	look := sockdiag.Open(c.Proc)
	defer look.Close()
	for i, p := range pairs {
		l, ok1 := p.Local.(*net.TCPAddr)
		r, ok2 := p.Remote.(*net.TCPAddr)
		if !ok1 || !ok2 {
			out[i] = Verdict{Peer: addrString(p.Remote), Reason: "not a TCP connection"}
			continue
		}
		out[i].Peer = r.String()
		inode, uid, err := look.Find(l, r)
		if err != nil {
			out[i].Reason = err.Error()
			continue
		}
		out[i].UID, out[i].HasUID = uid, true
		inodes[i] = inode
		want[inode] = struct{}{}
	}
	if len(want) == 0 {
		return out
	}
	owners, err := c.socketOwners(want)
	if err != nil {
		for i := range out {
			if inodes[i] != 0 {
				out[i].Reason = err.Error()
			}
		}
		return out
	}
	type nsVerdict struct {
		same bool
		err  error
	}
	byPid := map[int]nsVerdict{}
	for i, inode := range inodes {
		if inode == 0 {
			continue
		}
		o, ok := owners[inode]
		if !ok {
			out[i].Reason = fmt.Sprintf("no process holds the client socket (inode %d)", inode)
			continue
		}
		out[i].Peer = fmt.Sprintf("%s pid %d (%s) uid %d", out[i].Peer, o.pid, o.comm, out[i].UID)
		out[i].Client = "pid " + strconv.Itoa(o.pid)
		nv, seen := byPid[o.pid]
		if !seen {
			nv.same, nv.err = c.sameMountNamespace(o.pid)
			byPid[o.pid] = nv
		}
		switch {
		case nv.err != nil:
			out[i].Reason = nv.err.Error()
		case !nv.same:
			out[i].Reason = "the client runs in another mount namespace (a container)"
		default:
			out[i].FromHost = true
		}
	}
	return out
}

// owner is the process found holding a socket.
type owner struct {
	pid  int
	comm string
}

func addrString(a net.Addr) string {
	if a == nil {
		return "unknown"
	}
	return a.String()
}
