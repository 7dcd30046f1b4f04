// Package ptyio reads a job's pseudo-terminal for the runner: only once the
// terminal holds input (not each byte as it comes), and in plain reads
// once the job ended, so the last output is drained.
package ptyio

import (
	"errors"
	"io"
	"os"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/tandem-run/tandem/common/rawnet"
)

// Reader reads a pty master only once the terminal holds input.
//
// A read of an empty pty waits inside the kernel for the terminal's flush
// work to move the job's output over (and comes back EAGAIN when there was
// none), so with the runner's one P the Go runtime saw a syscall that
// outlasted its 20 µs tick at almost every read and handed the P to
// another thread: the monitor thread's wake-ups and those hand-offs were a
// third of the runner's CPU time while a job printed. Asking for the input
// count first (TIOCINQ, a quick ioctl) and waiting on the poller when
// there is none keeps every read short. After a wake-up the read goes
// straight through, so a hang-up (EIO once the job's side is closed) is
// seen like any read. On 2 vCPUs the job log pipeline went from 0.77-0.84
// to 0.93-1.08 of a raw pty reader, alternating runs. Not safe for
// concurrent Reads.
//
// A read hands over at most the line discipline's 4 KiB, so a job that
// prints fast costs a read per 4 KiB; after a read that took a whole
// buffer the count is skipped (more is almost always queued: the kernel
// moves it over within the read), which took a system call off every 4
// KiB: the runner's CPU per MiB fell from ~12.3 to ~10.8 ms and the
// pipeline went from ~0.52 to ~0.60 of the raw reader (log bench, three
// alternating rounds of three). An empty terminal then answers EAGAIN (the
// descriptor is non-blocking, see NewReader) and the Read waits on the
// poller as before.
//
// A waiting Read wakes on the poller's edge for new input or the hang-up;
// the runtime drops an edge that comes between two Reads, which for input
// is harmless (the count shows it) but for the hang-up would leave the
// wait with nothing to end it. So the owner calls Plain once the program
// on the other side exited, as a hang-up may then come at any moment:
// from then on reads go straight to the kernel, which reports it.
type Reader struct {
	f     *os.File
	rc    syscall.RawConn // nil: plain reads
	plain atomic.Bool
	// full: the last read took a whole line-discipline buffer, so more
	// output is most likely queued behind it.
	full bool
}

// ldiscBuf is what one read of a pty can return at most: the terminal's
// line discipline holds 4 KiB and hands over 4095 bytes of it at a time.
const ldiscBuf = 4095

// NewReader returns a Reader of the pty master f. It makes f's descriptor
// non-blocking: the raw reads must never sleep in the kernel, as a raw
// call keeps the scheduler's P (with one P the whole process, and at a
// garbage collection's stop-the-world every goroutine, would wait for the
// job's next output). creack/pty's Open leaves the master blocking (it
// takes the descriptor with os.File.Fd, which does that), and so would any
// later Fd: the owner reaches the descriptor through SyscallConn only.
// Without a non-blocking descriptor the Reader makes plain reads.
func NewReader(f *os.File) *Reader {
	r := &Reader{f: f}
	rc, err := f.SyscallConn()
	if err != nil {
		return r
	}
	var nerr error
	if err := rc.Control(func(fd uintptr) { nerr = unix.SetNonblock(int(fd), true) }); err == nil && nerr == nil {
		r.rc = rc
	}
	return r
}

// Plain switches to plain reads and wakes a Read waiting for input.
func (r *Reader) Plain() {
	r.plain.Store(true)
	_ = r.f.SetReadDeadline(time.Now())
}

// readPlain is a plain read; it clears the deadline Plain set to wake a
// waiting Read.
func (r *Reader) readPlain(buf []byte) (int, error) {
	for {
		n, err := r.f.Read(buf)
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			return n, err
		}
		_ = r.f.SetReadDeadline(time.Time{})
	}
}

// Read reads what the terminal holds, waiting until it holds something.
func (r *Reader) Read(buf []byte) (int, error) {
	if r.rc == nil || r.plain.Load() {
		return r.readPlain(buf)
	}
	var n int
	var rerr error
	first := true
	err := r.rc.Read(func(fd uintptr) bool {
		if first {
			first = false
			// The count and a read of what it counted never wait, so
			// they go to the kernel as raw calls: a marked system call
			// wakes the runtime's monitor from its deep sleep, and a
			// woken monitor polls every 20 µs for a while (its wake-ups
			// were a seventh of the runner's CPU samples in a log flood;
			// the other marked calls, writes and pulls, still wake it).
			raw := len(buf) > 0
			if raw && !r.full { // after a full read, more is queued: no count
				var avail int32
				_, _, e := unix.RawSyscall(unix.SYS_IOCTL, fd, unix.TIOCINQ, uintptr(unsafe.Pointer(&avail)))
				switch {
				case e != 0:
					raw = false // no count: a plain read below
				case avail == 0:
					return false // wait for the poller
				}
			}
			if raw {
				var errno syscall.Errno
				if n, errno = rawnet.RawRead(fd, buf); errno != 0 {
					rerr = errno
				}
				return rerr != unix.EAGAIN
			}
		}
		n, rerr = unix.Read(int(fd), buf)
		return rerr != unix.EAGAIN
	})
	switch {
	case errors.Is(err, os.ErrDeadlineExceeded) && r.plain.Load():
		return r.readPlain(buf)
	case err != nil:
		return 0, err
	case rerr != nil:
		return 0, &os.PathError{Op: "read", Path: r.f.Name(), Err: rerr}
	case n == 0:
		return 0, io.EOF
	}
	r.full = n >= ldiscBuf
	return n, nil
}
