package origin

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// inodeLookup finds client sockets: an exact sock_diag lookup by the
// connection's 4-tuple (about 20 µs, one netlink socket for a batch), else
// a scan of /proc/net/tcp{,6} (about a millisecond: the kernel walks every
// hash bucket to print it).
type inodeLookup struct {
	c   Checker
	fd  int    // the netlink socket; -1: none
	seq uint32 // numbers its questions, so an answer is matched to its own
}

func (c Checker) inodeLookup() *inodeLookup {
	l := &inodeLookup{c: c, fd: -1}
	if c.Proc == "" || c.Proc == "/proc" {
		if fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG); err == nil {
			tv := unix.Timeval{Sec: 1}
			_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
			l.fd = fd
		}
	}
	return l
}

func (l *inodeLookup) close() {
	if l.fd >= 0 {
		unix.Close(l.fd)
		l.fd = -1
	}
}

// inode finds the client's socket: its inode and the uid that owns it (the
// fsuid of the process that made it, as the kernel keeps it).
func (l *inodeLookup) inode(local, remote *net.TCPAddr) (uint64, uint32, error) {
	if l.fd >= 0 {
		l.seq++
		inode, uid, err := diagInode(l.fd, l.seq, remote, local)
		if err == nil || errors.Is(err, ErrNotFound) {
			// The kernel's answer is exact: a socket it does not find (a
			// client that already closed, one in another namespace) is
			// not in /proc/net/tcp either, and scanning that table once
			// per connection of a closed flood froze the accept loop.
			return inode, uid, err
		}
	}
	return l.c.scanInode(local, remote)
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
				return 0, 0, ErrNotFound
			}
			// inet_diag_msg: ... idiag_uid at 64, idiag_inode at 68.
			if m.Header.Type == unix.SOCK_DIAG_BY_FAMILY && len(m.Data) >= 72 {
				if inode := ne.Uint32(m.Data[68:]); inode != 0 {
					return uint64(inode), ne.Uint32(m.Data[64:]), nil
				}
			}
			return 0, 0, ErrNotFound
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
func (c Checker) scanInode(local, remote *net.TCPAddr) (uint64, uint32, error) {
	for _, table := range []string{"tcp", "tcp6"} {
		b, err := os.ReadFile(filepath.Join(c.proc(), "net", table))
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
	return 0, 0, ErrNotFound
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

// socketOwners finds a process holding each socket inode in want, with one
// walk of the process table, newest process first: the client (an ssh
// session's forwarder, a CLI, a job) is usually younger than the
// long-lived daemons with many descriptors. The walk stops once every
// inode is found. Descriptor links are read relative to each fd
// directory, into one buffer.
func (c Checker) socketOwners(want map[uint64]struct{}) (map[uint64]owner, error) {
	found := make(map[uint64]owner, len(want))
	proc, err := os.Open(c.proc())
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", c.proc(), err)
	}
	names, err := proc.Readdirnames(-1)
	proc.Close()
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", c.proc(), err)
	}
	pids := make([]int, 0, len(names))
	for _, n := range names {
		if pid, err := strconv.Atoi(n); err == nil {
			pids = append(pids, pid)
		}
	}
	slices.SortFunc(pids, func(a, b int) int { return b - a })
	link := make([]byte, 64)
	for _, pid := range pids {
		comm := "" // read once per process, at its first match
		dir := filepath.Join(c.proc(), strconv.Itoa(pid), "fd")
		dfd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			continue
		}
		f := os.NewFile(uintptr(dfd), dir)
		fds, _ := f.Readdirnames(-1)
		for _, fd := range fds {
			n, err := unix.Readlinkat(dfd, fd, link)
			if err != nil {
				continue
			}
			inode, ok := socketLinkInode(link[:n])
			if !ok {
				continue
			}
			if _, ok := want[inode]; !ok {
				continue
			}
			if _, dup := found[inode]; dup {
				continue
			}
			if comm == "" {
				b, _ := os.ReadFile(filepath.Join(c.proc(), strconv.Itoa(pid), "comm"))
				comm = strings.TrimSpace(string(b))
			}
			found[inode] = owner{pid: pid, comm: comm}
		}
		f.Close()
		if len(found) == len(want) {
			break
		}
	}
	return found, nil
}

// socketLinkInode parses "socket:[12345]".
func socketLinkInode(b []byte) (uint64, bool) {
	const prefix = "socket:["
	if len(b) < len(prefix)+2 || string(b[:len(prefix)]) != prefix || b[len(b)-1] != ']' {
		return 0, false
	}
	v, err := strconv.ParseUint(string(b[len(prefix):len(b)-1]), 10, 64)
	return v, err == nil
}

func (c Checker) sameMountNamespace(pid int) (bool, error) {
	mine, err := os.Readlink(filepath.Join(c.proc(), "self", "ns", "mnt"))
	if err != nil {
		return false, fmt.Errorf("own mount namespace: %w", err)
	}
	theirs, err := os.Readlink(filepath.Join(c.proc(), strconv.Itoa(pid), "ns", "mnt"))
	if err != nil {
		return false, fmt.Errorf("mount namespace of pid %d: %w", pid, err)
	}
	return mine == theirs, nil
}
