//go:build linux && !cgo

package memtrim

import "golang.org/x/sys/unix"

// release without cgo: the same calls from Go, which faults some of its
// own pages back in between them (the shim is built with cgo).
func release(maps []Mapping, fd int) error {
	for _, m := range maps {
		if _, _, e := unix.Syscall(unix.SYS_MADVISE, m.Start, m.End-m.Start, unix.MADV_NOHUGEPAGE); e != 0 {
			return e
		}
		if _, _, e := unix.Syscall(unix.SYS_MADVISE, m.Start, m.End-m.Start, unix.MADV_RANDOM); e != 0 {
			return e
		}
	}
	for _, m := range maps {
		if _, _, e := unix.Syscall(unix.SYS_MADVISE, m.Start, m.End-m.Start, unix.MADV_DONTNEED); e != 0 {
			return e
		}
	}
	return unix.Fadvise(fd, 0, 0, unix.FADV_DONTNEED)
}
