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

// socketHolders finds every process holding each socket inode in want,
// with one walk of the whole process table: a socket passed to another
// process is held by both until one closes it, and each holder counts.
// Descriptor links are read relative to each fd directory, into one
// buffer; a holder's name and uids are read once, at its first match.
func (c Checker) socketHolders(want map[uint64]struct{}) (map[uint64][]holder, error) {
	found := make(map[uint64][]holder, len(want))
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
		var me *holder // this process, once it matched
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
			if me == nil {
				h, err := c.readHolder(pid)
				if err != nil {
					// A holder whose credentials cannot be read is not
					// left out: it is taken as nobody, which no policy
					// admits.
					h = holder{pid: pid, comm: "unknown", uids: [4]uint32{nobody, nobody, nobody, nobody}}
				}
				me = &h
			}
			if !slices.ContainsFunc(found[inode], func(o holder) bool { return o.pid == pid }) {
				found[inode] = append(found[inode], *me)
			}
		}
		f.Close()
	}
	return found, nil
}

// nobody stands for a holder whose uids could not be read.
const nobody = 65534

// readHolder reads a process's name and uids from its status file.
func (c Checker) readHolder(pid int) (holder, error) {
	b, err := os.ReadFile(filepath.Join(c.proc(), strconv.Itoa(pid), "status"))
	if err != nil {
		return holder{}, err
	}
	h := holder{pid: pid}
	gotUID := false
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		switch k {
		case "Name":
			h.comm = strings.TrimSpace(v)
		case "Uid":
			f := strings.Fields(v)
			if len(f) != 4 {
				return holder{}, fmt.Errorf("pid %d: status Uid %q", pid, v)
			}
			for i := range f {
				u, err := strconv.ParseUint(f[i], 10, 32)
				if err != nil {
					return holder{}, fmt.Errorf("pid %d: status Uid %q", pid, v)
				}
				h.uids[i] = uint32(u)
			}
			gotUID = true
		}
	}
	if !gotUID {
		return holder{}, fmt.Errorf("pid %d: no Uid in status", pid)
	}
	return h, nil
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
