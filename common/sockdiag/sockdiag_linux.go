// Package sockdiag finds who made a TCP socket on this host: the client's
// end of a connection to one of our listeners, by its 4-tuple, with its
// inode and owning uid as the kernel records them.
package sockdiag

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// Lookup finds client sockets: an exact sock_diag lookup by the
// connection's 4-tuple (about 20 µs, one netlink socket for a batch), else
// a scan of /proc/net/tcp{,6} (about a millisecond: the kernel walks every
// hash bucket to print it).
type Lookup struct {
	proc string
	fd   int    // the netlink socket; -1: none
	seq  uint32 // numbers its questions, so an answer is matched to its own
}

// Open prepares a Lookup; proc is the procfs root ("" or "/proc": the
// kernel's own tables, asked over netlink first).
func Open(proc string) *Lookup {
	if proc == "" {
		proc = "/proc"
	}
	l := &Lookup{proc: proc, fd: -1}
	if proc == "/proc" {
		if fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG); err == nil {
			tv := unix.Timeval{Sec: 1}
			_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
			l.fd = fd
		}
	}
	return l
}

// Close releases the netlink socket.
func (l *Lookup) Close() {
	if l.fd >= 0 {
		unix.Close(l.fd)
		l.fd = -1
	}
}

// Find finds the client's socket of the connection between local (the
// server's end) and remote (the client's end): its inode and the uid that
// owns it (the fsuid of the process that made it, as the kernel keeps it).
func (l *Lookup) Find(local, remote *net.TCPAddr) (uint64, uint32, error) {
	if l.fd >= 0 {
		l.seq++
		inode, uid, err := diagInode(l.fd, l.seq, remote, local)
		if err == nil || errors.Is(err, ErrNoSocket) {
			// The kernel's answer is exact: a socket it does not find (a
			// client that already closed, one in another namespace) is
			// not in /proc/net/tcp either, and scanning that table once
			// per connection of a closed flood froze the accept loop.
			return inode, uid, err
		}
	}
	return scanInode(l.proc, local, remote)
}

// diagInode asks NETLINK_SOCK_DIAG (on fd, question number seq) for the
// TCP socket whose local end is src and whose remote end is dst, and
// returns its inode and owner's uid.
func diagInode(fd int, seq uint32, src, dst *net.TCPAddr) (uint64, uint32, error) {
	family := uint8(unix.AF_INET)
	s4, d4 := src.IP.To4(), dst.IP.To4()
	if s4 == nil || d4 == nil {
		family = unix.AF_INET6
	}
	// nlmsghdr (16) + inet_diag_req_v2 (56).
	req := make([]byte, 72)
	ne := binary.NativeEndian
	ne.PutUint32(req[0:], 72)
	ne.PutUint16(req[4:], unix.SOCK_DIAG_BY_FAMILY)
	ne.PutUint16(req[6:], unix.NLM_F_REQUEST)
	ne.PutUint32(req[8:], seq)
	r := req[16:]
	r[0], r[1] = family, unix.IPPROTO_TCP
	ne.PutUint32(r[4:], 0xffffffff) // every state
	id := r[8:]
	binary.BigEndian.PutUint16(id[0:], uint16(src.Port))
	binary.BigEndian.PutUint16(id[2:], uint16(dst.Port))
	putIP(id[4:20], src.IP, family)
	putIP(id[20:36], dst.IP, family)
	ne.PutUint32(id[40:], 0xffffffff) // INET_DIAG_NOCOOKIE
	ne.PutUint32(id[44:], 0xffffffff)
	if err := unix.Sendto(fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return 0, 0, err
	}
	buf := make([]byte, 8192)
	for {
		n, _, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			return 0, 0, err
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			return 0, 0, err
		}
		for _, m := range msgs {
			if m.Header.Seq != seq {
				continue // a late answer to an earlier question on this socket
			}
			if m.Header.Type == unix.NLMSG_ERROR {
				return 0, 0, ErrNoSocket
			}
			// inet_diag_msg: ... idiag_uid at 64, idiag_inode at 68.
			if m.Header.Type == unix.SOCK_DIAG_BY_FAMILY && len(m.Data) >= 72 {
				if inode := ne.Uint32(m.Data[68:]); inode != 0 {
					return uint64(inode), ne.Uint32(m.Data[64:]), nil
				}
			}
			return 0, 0, ErrNoSocket
		}
	}
}

func putIP(dst []byte, ip net.IP, family uint8) {
	if family == unix.AF_INET {
		copy(dst, ip.To4())
		return
	}
	copy(dst, ip.To16())
}

// scanInode finds the client's socket in /proc/net/tcp{,6}: the entry
// whose local end is the client's address and whose remote end is ours,
// and its uid column.
func scanInode(proc string, local, remote *net.TCPAddr) (uint64, uint32, error) {
	for _, table := range []string{"tcp", "tcp6"} {
		b, err := os.ReadFile(filepath.Join(proc, "net", table))
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(bytes.NewReader(b))
		sc.Scan() // header
		for sc.Scan() {
			f := strings.Fields(sc.Text())
			if len(f) < 10 {
				continue
			}
			if !addrIs(f[1], remote) || !addrIs(f[2], local) {
				continue
			}
			inode, err := strconv.ParseUint(f[9], 10, 64)
			if err != nil || inode == 0 {
				continue
			}
			uid, err := strconv.ParseUint(f[7], 10, 32)
			if err != nil {
				continue
			}
			return inode, uint32(uid), nil
		}
	}
	return 0, 0, ErrNoSocket
}

// addrIs compares a /proc/net/tcp address ("0100007F:1F90": the IP as
// 32-bit words in host byte order, the port in hex) with a.
func addrIs(s string, a *net.TCPAddr) bool {
	hexIP, hexPort, ok := strings.Cut(s, ":")
	if !ok {
		return false
	}
	port, err := strconv.ParseUint(hexPort, 16, 16)
	if err != nil || int(port) != a.Port {
		return false
	}
	raw, err := hex.DecodeString(hexIP)
	if err != nil || len(raw)%4 != 0 {
		return false
	}
	ip := make(net.IP, len(raw))
	for i := 0; i < len(raw); i += 4 {
		binary.BigEndian.PutUint32(ip[i:], binary.LittleEndian.Uint32(raw[i:]))
	}
	return ip.Equal(a.IP)
}
