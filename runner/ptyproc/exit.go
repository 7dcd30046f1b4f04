// Package ptyproc is the runner's process layer: what the job executor and
// the SSH server both do with the processes they start. So far: how a
// finished process's status is reported.
package ptyproc

import (
	"errors"
	"os"
	"os/exec"
	"syscall"
)

// ExitStatus is a finished process's status as a shell (and docker)
// reports it: its exit code, or 128 + the number of the signal that killed
// it, which killedBy then names.
func ExitStatus(ps *os.ProcessState) (code int, killedBy syscall.Signal) {
	if ps == nil {
		return 255, 0
	}
	if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return 128 + int(ws.Signal()), ws.Signal()
	}
	return ps.ExitCode(), 0
}

// FromWait turns cmd.Wait's error into an exit status: 0 for nil, the
// process's status for an exit error (a signal included), 255 when the
// wait itself failed.
func FromWait(err error) int {
	if err == nil {
		return 0
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code, _ := ExitStatus(ee.ProcessState)
		return code
	}
	return 255
}
