package origin

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

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
