package ptyproc

import (
	"errors"

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
	return unix.IoctlGetInt(int(p.master.Fd()), unix.TIOCGPGRP)
}

// Interrupt types the terminal's interrupt character (Ctrl-C unless the
// job changed it): the foreground group gets SIGINT from the line
// discipline, even under an interactive shell.
func (p *Proc) Interrupt() error {
	if p.master == nil {
		return errNoTerminal
	}
	intr := byte(3)
	if t, err := unix.IoctlGetTermios(int(p.master.Fd()), unix.TCGETS); err == nil && t.Cc[unix.VINTR] != 0 {
		intr = t.Cc[unix.VINTR]
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
	return unix.IoctlGetInt(int(p.master.Fd()), unix.TIOCINQ)
}
