package sshd

import (
	"errors"
	"os"
	"syscall"
)

// What an SSH client reads when something fails is chosen here, never an
// internal error's text (a path of the runner's, Go's wording): the
// runner's log has the cause, with the user and the remote address.

// sessionFailure is what a client sees when its session cannot start.
const sessionFailure = "tandem: the session could not start (the runner's log has the cause)"

// connectFailure words a failed forward's connect as OpenSSH does
// ("connect failed: Connection refused"): the system's reason, which the
// client's own target decides, without the address and Go's wording.
func connectFailure(err error) string {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		if s := errno.Error(); s != "" {
			return "connect failed: " + string(s[0]-'a'+'A') + s[1:]
		}
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return "connect failed: Connection timed out"
	}
	return "connect failed"
}
