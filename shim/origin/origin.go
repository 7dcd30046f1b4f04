// Package origin tells whether a TCP connection to the shim comes from the
// host itself or from inside a container. A job in host network mode shares
// the host's loopback, so the address cannot tell: the process that owns
// the client's socket can. Its mount namespace is the host's for sshd (the
// dstack server's tunnel), tandem and anything else running on the host,
// and a container's own for every job.
//
// A socket is a descriptor, and descriptors pass between processes
// (SCM_RIGHTS over a unix socket; an abstract one is shared by every
// process of a network namespace, a host-network job's included): the one
// that made it, the one that holds it and the one that writes the requests
// need not be the same. So a connection is the host's only when every
// process holding its socket at accept is in the host's mount namespace,
// and its uids are all of theirs (real, effective, saved and filesystem)
// with the kernel's record of the socket's maker: a container's root
// handing a socket to a local account, or an account handing its socket
// to a set-uid program, is judged by the weakest of them.
package origin

import (
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"

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
	// UIDs are every uid behind the client's socket: the kernel's record
	// of who made it, then each holder's real, effective, saved and
	// filesystem uids, without repeats. Empty when the socket was not
	// found; a policy admits the connection only if it admits them all.
	UIDs []uint32
}

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
		out[i].UIDs = []uint32{uid}
		inodes[i] = inode
		want[inode] = struct{}{}
	}
	if len(want) == 0 {
		return out
	}
	holders, err := c.socketHolders(want)
	if err != nil {
		for i := range out {
			if inodes[i] != 0 {
				out[i].Reason = err.Error()
				out[i].UIDs = nil
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
		hs := holders[inode]
		if len(hs) == 0 {
			out[i].Reason = fmt.Sprintf("no process holds the client socket (inode %d)", inode)
			continue
		}
		out[i].Client = "pid " + strconv.Itoa(hs[0].pid)
		desc := make([]string, 0, len(hs))
		out[i].FromHost = true
		for _, h := range hs {
			desc = append(desc, fmt.Sprintf("pid %d (%s) uid %d", h.pid, h.comm, h.uids[1]))
			for _, u := range h.uids {
				if !slices.Contains(out[i].UIDs, u) {
					out[i].UIDs = append(out[i].UIDs, u)
				}
			}
			nv, seen := byPid[h.pid]
			if !seen {
				nv.same, nv.err = c.sameMountNamespace(h.pid)
				byPid[h.pid] = nv
			}
			switch {
			case !out[i].FromHost:
			case nv.err != nil:
				out[i].FromHost, out[i].Reason = false, nv.err.Error()
			case !nv.same:
				out[i].FromHost = false
				out[i].Reason = "the client runs in another mount namespace (a container)"
				if len(hs) > 1 {
					out[i].Reason = fmt.Sprintf("a process holding the client socket (pid %d) runs in another mount namespace (a container)", h.pid)
				}
			}
		}
		if len(hs) > 4 {
			desc = append(desc[:4], fmt.Sprintf("and %d more", len(hs)-4))
		}
		out[i].Peer = out[i].Peer + " " + strings.Join(desc, ", ")
	}
	return out
}

// holder is a process found holding a socket.
type holder struct {
	pid  int
	comm string
	uids [4]uint32 // real, effective, saved, filesystem
}

func addrString(a net.Addr) string {
	if a == nil {
		return "unknown"
	}
	return a.String()
}
