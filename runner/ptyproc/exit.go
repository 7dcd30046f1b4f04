// Package ptyproc is the runner's process layer: the job, SSH sessions and
// sftp start their processes through Start (a terminal or pipes, the
// user's credentials, signals to the group or session, a hang-up) and read
// their end from Wait, as a shell reports it (128+N for signal N; 126/127
// when they cannot start). This file: the exit status.
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
