package ptyproc

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// What a stop needs of the process's terminal, as a person at it would
// see it: who has it, what Ctrl-C types, what is typed but unread.

var errNoTerminal = errors.New("no terminal")

// ForegroundGroup is the process group that has the terminal: the
// session's own (Pid) when its leader, a shell, has it back; a job's
// otherwise.
func (p *Proc) ForegroundGroup() (int, error) {
	if p.master == nil {
		return 0, errNoTerminal
	}
	var pgrp int
	err := p.control(func(fd int) (err error) {
		pgrp, err = unix.IoctlGetInt(fd, unix.TIOCGPGRP)
		return err
	})
	return pgrp, err
}

// Interrupt is Ctrl-C at the terminal: the foreground process group gets
// SIGINT, as the line discipline sends it, even under an interactive
// shell. The signal is sent directly rather than the interrupt character
// typed: a typed one is echoed by the terminal (ECHOCTL) as "^C" into the
// job's output, and the line discipline flushes the output not yet read
// with it. A terminal whose signals are off (ISIG clear: a program in raw
// mode reads its keys itself) gets its interrupt character typed, as a
// person's key would reach it.
func (p *Proc) Interrupt() error {
	if p.master == nil {
		return errNoTerminal
	}
	intr, isig := byte(3), true
	_ = p.control(func(fd int) error {
		t, err := unix.IoctlGetTermios(fd, unix.TCGETS)
		if err == nil {
			if t.Cc[unix.VINTR] != 0 {
				intr = t.Cc[unix.VINTR]
			}
			isig = t.Lflag&unix.ISIG != 0
		}
		return err
	})
	if isig {
		if fg, err := p.ForegroundGroup(); err == nil && fg > 0 {
			if err := unix.Kill(-fg, unix.SIGINT); err == nil || errors.Is(err, unix.ESRCH) {
				return nil
			}
		}
	}
	_, err := p.master.Write([]byte{intr})
	return err
}

// Unread is how many bytes of output wait in the terminal, written but not
// read from the master yet.
func (p *Proc) Unread() (int, error) {
	if p.master == nil {
		return 0, errNoTerminal
	}
	var n int
	err := p.control(func(fd int) (err error) {
		n, err = unix.IoctlGetInt(fd, unix.TIOCINQ)
		return err
	})
	return n, err
}

// control runs fn on the master's descriptor. The descriptor is never
// taken with Fd: Fd puts it back into blocking mode (creack/pty's Open and
// Setsize do so), and the job's output reader (ptyio) makes raw reads of
// it that must never sleep in the kernel: a raw call keeps the scheduler's
// P, so a blocking read of a quiet terminal would stop the whole runner
// (with one P, or at the next garbage collection's stop-the-world) until
// the job printed again.
func (p *Proc) control(fn func(fd int) error) error {
	rc, err := p.master.SyscallConn()
	if err != nil {
		return fmt.Errorf("terminal: %w", err)
	}
	var ferr error
	if err := rc.Control(func(fd uintptr) { ferr = fn(int(fd)) }); err != nil {
		return fmt.Errorf("terminal: %w", err)
	}
	return ferr
}
