package sshd

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/tandem-run/tandem/runner/account"
	"golang.org/x/sys/unix"
)

// Forwarding sockets are opened with the login user's credentials, never
// root's on their behalf: the runner re-executes itself as `sock-helper`
// under the user's uid and groups, the helper dials or listens, and passes
// the socket back over a socketpair (SCM_RIGHTS). The kernel then checks
// what the user may reach (a root-only Unix socket, a 0700 home) and what
// the user may create, and a socket made by -R belongs to the user. Data
// flows in the runner afterwards: only the open costs a fork.

// SockHelperCommand is the hidden runner subcommand that opens one socket.
const SockHelperCommand = "sock-helper"

// needsHelper says whether opening for login must go through the helper.
func (s *Server) needsHelper(login account.Login) bool {
	return s.cfg.CanSetUser && login.UID != os.Geteuid()
}

// dialAs connects to addr as login.
func (s *Server) dialAs(ctx context.Context, login account.Login, network, addr string) (net.Conn, error) {
	if !s.needsHelper(login) {
		var d net.Dialer
		return d.DialContext(ctx, network, addr)
	}
	f, err := s.helper(ctx, login, "dial", network, addr)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return net.FileConn(f)
}

// listenAs listens on addr as login.
func (s *Server) listenAs(ctx context.Context, login account.Login, network, addr string) (net.Listener, error) {
	if !s.needsHelper(login) {
		return net.Listen(network, addr)
	}
	f, err := s.helper(ctx, login, "listen", network, addr)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return net.FileListener(f)
}

func (s *Server) helper(ctx context.Context, login account.Login, op, network, addr string) (*os.File, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("socketpair: %w", err)
	}
	parent, child := os.NewFile(uintptr(fds[0]), "sock-helper"), os.NewFile(uintptr(fds[1]), "sock-helper-child")
	defer parent.Close()
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, s.cfg.Self, SockHelperCommand, op, network, addr)
	cmd.ExtraFiles = []*os.File{child} // fd 3
	cmd.Env = []string{"PATH=/usr/bin:/bin"}
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred(login).Sys()}
	if err := cmd.Start(); err != nil {
		child.Close()
		return nil, fmt.Errorf("start %s: %w", SockHelperCommand, err)
	}
	child.Close()
	defer func() { _ = cmd.Wait() }()
	buf := make([]byte, 1024)
	oob := make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := unix.Recvmsg(fds[0], buf, oob, 0)
	if err != nil {
		return nil, fmt.Errorf("%s %s %s: %w", op, network, addr, err)
	}
	msg := string(buf[:n])
	if reason, failed := strings.CutPrefix(msg, "err "); failed {
		// "err <errno> <text>": the errno survives the trip, so what a
		// client is told can be worded from it (visible.go).
		num, text, _ := strings.Cut(reason, " ")
		if n, perr := strconv.Atoi(num); perr == nil && n > 0 {
			return nil, fmt.Errorf("%s: %w", text, syscall.Errno(n))
		}
		return nil, errors.New(text)
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(msgs) != 1 {
		return nil, fmt.Errorf("%s %s %s: no socket came back", op, network, addr)
	}
	got, err := unix.ParseUnixRights(&msgs[0])
	if err != nil || len(got) != 1 {
		return nil, fmt.Errorf("%s %s %s: no socket came back", op, network, addr)
	}
	unix.CloseOnExec(got[0])
	return os.NewFile(uintptr(got[0]), network+":"+addr), nil
}

// ServeSockHelper is the helper's side: args are op, network, addr; fd 3
// is the socketpair back to the runner.
func ServeSockHelper(args []string) error {
	ctl := 3
	reply := func(msg string, fd int) error {
		var oob []byte
		if fd >= 0 {
			oob = unix.UnixRights(fd)
		}
		return unix.Sendmsg(ctl, []byte(msg), oob, nil, 0)
	}
	fail := func(err error) error {
		var errno syscall.Errno
		n := 0
		if errors.As(err, &errno) {
			n = int(errno)
		}
		_ = reply(fmt.Sprintf("err %d %v", n, err), -1)
		return err
	}
	if len(args) != 3 {
		_ = reply("err 0 usage: sock-helper dial|listen tcp|unix ADDR", -1)
		return errors.New("usage: sock-helper dial|listen tcp|unix ADDR")
	}
	op, network, addr := args[0], args[1], args[2]
	if network != "tcp" && network != "unix" {
		_ = reply("err 0 network must be tcp or unix", -1)
		return errors.New("network must be tcp or unix")
	}
	type filer interface{ File() (*os.File, error) }
	var f filer
	switch op {
	case "dial":
		c, err := net.DialTimeout(network, addr, 10*time.Second)
		if err != nil {
			return fail(err)
		}
		f = c.(filer)
	case "listen":
		l, err := net.Listen(network, addr)
		if err != nil {
			return fail(err)
		}
		if ul, ok := l.(*net.UnixListener); ok {
			ul.SetUnlinkOnClose(false) // the runner owns the socket now
		}
		f = l.(filer)
	default:
		_ = reply("err 0 op must be dial or listen", -1)
		return errors.New("op must be dial or listen")
	}
	file, err := f.File()
	if err != nil {
		return fail(err)
	}
	return reply("ok", int(file.Fd()))
}
