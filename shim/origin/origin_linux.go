package origin

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/hex"
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

// socketInode finds the client's socket: an exact sock_diag lookup by the
// connection's 4-tuple (about 20 µs), else a scan of /proc/net/tcp{,6}
// (about a millisecond: the kernel walks every hash bucket to print it).
func (c Checker) socketInode(local, remote *net.TCPAddr) (uint64, error) {
	if c.Proc == "" || c.Proc == "/proc" {
		if inode, err := diagInode(remote, local); err == nil {
			return inode, nil
		}
	}
	return c.scanInode(local, remote)
}

// diagInode asks NETLINK_SOCK_DIAG for the TCP socket whose local end is
// src and whose remote end is dst, and returns its inode.
func diagInode(src, dst *net.TCPAddr) (uint64, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	tv := unix.Timeval{Sec: 1}
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
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
	ne.PutUint32(req[8:], 1)
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
		return 0, err
	}
	buf := make([]byte, 8192)
	n, _, err := unix.Recvfrom(fd, buf, 0)
	if err != nil {
		return 0, err
	}
	msgs, err := syscall.ParseNetlinkMessage(buf[:n])
	if err != nil {
		return 0, err
	}
	for _, m := range msgs {
		if m.Header.Type == unix.NLMSG_ERROR {
			return 0, ErrNotFound
		}
		if m.Header.Type == unix.SOCK_DIAG_BY_FAMILY && len(m.Data) >= 72 {
			if inode := ne.Uint32(m.Data[68:]); inode != 0 {
				return uint64(inode), nil
			}
		}
	}
	return 0, ErrNotFound
}

func putIP(dst []byte, ip net.IP, family uint8) {
	if family == unix.AF_INET {
		copy(dst, ip.To4())
		return
	}
	copy(dst, ip.To16())
}

// scanInode finds the client's socket in /proc/net/tcp{,6}: the entry
// whose local end is the client's address and whose remote end is ours.
func (c Checker) scanInode(local, remote *net.TCPAddr) (uint64, error) {
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
			return inode, nil
		}
	}
	return 0, ErrNotFound
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

// socketOwner finds a process holding the socket inode.
func (c Checker) socketOwner(inode uint64) (int, string, error) {
	want := "socket:[" + strconv.FormatUint(inode, 10) + "]"
	entries, err := os.ReadDir(c.proc())
	if err != nil {
		return 0, "", fmt.Errorf("read %s: %w", c.proc(), err)
	}
	// Newest first: the client (an ssh session's forwarder, a CLI, a job)
	// is usually younger than the long-lived daemons with many descriptors.
	pids := make([]int, 0, len(entries))
	for _, e := range entries {
		if pid, err := strconv.Atoi(e.Name()); err == nil {
			pids = append(pids, pid)
		}
	}
	slices.SortFunc(pids, func(a, b int) int { return b - a })
	for _, pid := range pids {
		fdDir := filepath.Join(c.proc(), strconv.Itoa(pid), "fd")
		fds, err := os.ReadDir(fdDir)
		if err != nil {
			continue
		}
		for _, fd := range fds {
			if link, err := os.Readlink(filepath.Join(fdDir, fd.Name())); err == nil && link == want {
				comm, _ := os.ReadFile(filepath.Join(c.proc(), strconv.Itoa(pid), "comm"))
				return pid, strings.TrimSpace(string(comm)), nil
			}
		}
	}
	return 0, "", fmt.Errorf("no process holds the client socket (inode %d)", inode)
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
