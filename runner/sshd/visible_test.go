package sshd

import (
	"errors"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
)

// A forward's failed connect reads as OpenSSH words it, never with the
// runner's addresses, paths or Go's wording.
func TestConnectFailureWords(t *testing.T) {
	refused := &net.OpError{Op: "dial", Net: "tcp", Addr: &net.TCPAddr{IP: net.IPv4(10, 1, 2, 3), Port: 8080},
		Err: &os.SyscallError{Syscall: "connect", Err: syscall.ECONNREFUSED}}
	missing := &net.OpError{Op: "dial", Net: "unix", Err: &os.SyscallError{Syscall: "connect", Err: syscall.ENOENT}}
	cases := map[error]string{
		refused: "connect failed: Connection refused",
		missing: "connect failed: No such file or directory",
		&net.OpError{Op: "dial", Err: os.ErrDeadlineExceeded}:        "connect failed: Connection timed out",
		errors.New("helper: open /proc/1/ns/net: permission denied"): "connect failed",
	}
	for err, want := range cases {
		got := connectFailure(err)
		if got != want {
			t.Errorf("%v: %q, want %q", err, got, want)
		}
		if strings.Contains(got, "/") || strings.Contains(got, "10.1.2.3") || strings.Contains(got, "dial") {
			t.Errorf("%q carries the cause", got)
		}
	}
}
