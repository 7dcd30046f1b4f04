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

// Interrupt types the terminal's interrupt character (Ctrl-C unless the
// job changed it): the foreground group gets SIGINT from the line
// discipline, even under an interactive shell.
func (p *Proc) Interrupt() error {
	if p.master == nil {
		return errNoTerminal
	}
	intr := byte(3)
	_ = p.control(func(fd int) error {
		t, err := unix.IoctlGetTermios(fd, unix.TCGETS)
		if err == nil && t.Cc[unix.VINTR] != 0 {
			intr = t.Cc[unix.VINTR]
		}
		return err
	})
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
