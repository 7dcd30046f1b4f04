package sshd

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"

	gssh "github.com/gliderlabs/ssh"
	"github.com/tandem-run/tandem/runner/account"
	"github.com/tandem-run/tandem/runner/ptyio"
	"github.com/tandem-run/tandem/runner/ptyproc"
)

// acceptedEnv are the client variables a session takes (as dstack's sshd
// AcceptEnv).
func acceptedEnv(kv string) bool {
	k, _, _ := strings.Cut(kv, "=")
	return k == "LANG" || strings.HasPrefix(k, "LC_") || k == "COLORTERM" || k == "NO_COLOR"
}

// noLogin reports a shell that refuses logins (nologin, false): such a
// user gets no session, as with OpenSSH (forwarding still works).
func noLogin(shell string) bool {
	return strings.HasSuffix(shell, "/nologin") || strings.HasSuffix(shell, "/false")
}

// shellFor picks the user's shell, else /bin/sh, else busybox's (an image
// whose passwd names a shell it does not ship).
func shellFor(login account.Login) []string {
	usable := func(p string) bool {
		if p == "" || noLogin(p) {
			return false
		}
		fi, err := os.Stat(p)
		return err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0
	}
	switch {
	case usable(login.Shell):
		return []string{login.Shell}
	case usable("/bin/sh"):
		return []string{"/bin/sh"}
	case usable("/bin/busybox"):
		return []string{"/bin/busybox", "sh"}
	}
	return nil
}

// cred is who the login's processes run as; nil (the runner's user) when
// the runner cannot switch users.
func (s *Server) cred(login account.Login) *ptyproc.Cred {
	if !s.cfg.CanSetUser {
		return nil
	}
	return &ptyproc.Cred{UID: login.UID, GID: login.GID, Groups: login.Groups}
}

// homeOrRoot is the login's home when it is a directory, else /: where
// its sessions start.
func homeOrRoot(login account.Login) string {
	if fi, err := os.Stat(login.Home); err == nil && fi.IsDir() {
		return login.Home
	}
	return "/"
}

// sessionEnv is the job's environment plus the login's identity.
func (s *Server) sessionEnv(sess gssh.Session, login account.Login, shell string) []string {
	env := map[string]string{}
	if s.cfg.Env != nil {
		for _, kv := range s.cfg.Env() {
			if k, v, ok := strings.Cut(kv, "="); ok {
				env[k] = v
			}
		}
	}
	for _, kv := range sess.Environ() {
		if acceptedEnv(kv) {
			k, v, _ := strings.Cut(kv, "=")
			env[k] = v
		}
	}
	env["HOME"], env["USER"], env["LOGNAME"], env["SHELL"] = login.Home, sess.User(), sess.User(), shell
	if env["PATH"] == "" {
		env["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	}
	if ra, ok := sess.RemoteAddr().(*net.TCPAddr); ok {
		if la, ok := sess.LocalAddr().(*net.TCPAddr); ok {
			env["SSH_CLIENT"] = fmt.Sprintf("%s %d %d", ra.IP, ra.Port, la.Port)
			env["SSH_CONNECTION"] = fmt.Sprintf("%s %d %s %d", ra.IP, ra.Port, la.IP, la.Port)
		}
	}
	return account.EnvList(env)
}

func (s *Server) session(sess gssh.Session) {
	log := s.cfg.Log.With("user", sess.User(), "remote", sess.RemoteAddr().String())
	login, err := s.login(sess.Context())
	if err != nil {
		log.Warn("ssh session: the account cannot be used", "err", err)
		fmt.Fprint(sess.Stderr(), sessionFailure+"\r\n")
		_ = sess.Exit(254)
		return
	}
	if noLogin(login.Shell) {
		log.Info("ssh session refused: the account's shell refuses logins", "shell", login.Shell)
		fmt.Fprint(sess.Stderr(), "This account is currently not available.\r\n")
		_ = sess.Exit(1)
		return
	}
	opts := s.grant(sess.Context())
	shellArgv := shellFor(login)
	if shellArgv == nil {
		fmt.Fprintf(sess.Stderr(), "tandem: no shell in this image (tried %q, /bin/sh, busybox)\r\n", login.Shell)
		_ = sess.Exit(127)
		return
	}
	env := s.sessionEnv(sess, login, shellArgv[0])
	if s.cfg.PermitUserEnvironment {
		env = append(env, opts.env...)
	}
	if gssh.AgentRequested(sess) && opts.noAgent {
		log.Info("agent forwarding refused: no-agent-forwarding")
	} else if gssh.AgentRequested(sess) {
		if sock, closeAgent, err := s.agentSocket(sess, login); err == nil {
			defer closeAgent()
			env = append(env, "SSH_AUTH_SOCK="+sock)
		} else {
			log.Warn("agent forwarding", "err", err)
		}
	}
	spec := ptyproc.Spec{Path: shellArgv[0], Dir: homeOrRoot(login)}
	if opts.hasCommand {
		// command= runs instead of whatever was asked (a shell, a command,
		// a subsystem); what was asked is in SSH_ORIGINAL_COMMAND.
		if raw := sess.RawCommand(); raw != "" {
			env = append(env, "SSH_ORIGINAL_COMMAND="+raw)
		}
		spec.Args = append(slices.Clone(shellArgv), "-c", opts.command)
	} else if raw := sess.RawCommand(); raw != "" {
		spec.Args = append(slices.Clone(shellArgv), "-c", raw)
	} else {
		spec.Args = append(slices.Clone(shellArgv), "-l")
		spec.Args[0] = "-" + filepath.Base(shellArgv[0]) // a login shell
	}
	spec.Env = env
	code, err := s.run(sess, spec, login)
	if err != nil {
		log.Warn("ssh session", "err", err)
		fmt.Fprint(sess.Stderr(), sessionFailure+"\r\n")
	}
	_ = sess.Exit(code)
}

// run starts spec for the session (in a pty if one was requested) and
// returns its exit status.
func (s *Server) run(sess gssh.Session, spec ptyproc.Spec, login account.Login) (int, error) {
	sigs := make(chan gssh.Signal, 4)
	sess.Signals(sigs)
	defer sess.Signals(nil)
	spec.Cred = s.cred(login)
	ptyReq, winCh, isPty := sess.Pty()
	if !isPty {
		spec.Stdin, spec.Stdout, spec.Stderr = sess, sess, sess.Stderr()
		proc, err := ptyproc.Start(spec)
		if err != nil {
			return startCode(err), err
		}
		// exec copies the output before Wait returns: every byte is sent
		// before exit-status.
		return s.wait(sess, proc, sigs), nil
	}
	spec.Env = append(spec.Env, "TERM="+ptyReq.Term)
	spec.TTY, spec.Size = true, &ptyproc.Size{Rows: uint16(ptyReq.Window.Height), Cols: uint16(ptyReq.Window.Width)}
	proc, err := ptyproc.Start(spec)
	if err != nil {
		return startCode(err), err
	}
	defer proc.Close()
	go func() {
		for w := range winCh {
			_ = proc.Resize(ptyproc.Size{Rows: uint16(w.Height), Cols: uint16(w.Width)})
		}
	}()
	go func() { _, _ = io.Copy(proc.Terminal(), sess) }()
	out := make(chan struct{})
	reader := ptyio.NewReader(proc.Terminal())
	go func() { _, _ = io.Copy(sess, reader); close(out) }()
	code := s.wait(sess, proc, sigs)
	reader.Plain() // the shell exited: its hang-up may come any moment
	<-out          // the terminal drained: every byte is sent before exit-status
	return code, nil
}

// startCode is the exit status of a process that did not start.
func startCode(err error) int {
	var se *ptyproc.StartError
	if errors.As(err, &se) {
		return se.Code
	}
	return 255
}

// wait waits for proc, forwarding the client's signals to its process group
// and hanging it up when the client goes away.
func (s *Server) wait(sess gssh.Session, proc *ptyproc.Proc, sigs <-chan gssh.Signal) int {
	for {
		select {
		case <-proc.Exited():
			code, _ := proc.Wait()
			return code
		case sig := <-sigs:
			if n, ok := signals[sig]; ok {
				_ = proc.Signal(n)
			}
		case <-sess.Context().Done():
			_ = proc.HangUp()
			code, _ := proc.Wait()
			return code
		}
	}
}

var signals = map[gssh.Signal]syscall.Signal{
	gssh.SIGABRT: syscall.SIGABRT, gssh.SIGALRM: syscall.SIGALRM, gssh.SIGFPE: syscall.SIGFPE,
	gssh.SIGHUP: syscall.SIGHUP, gssh.SIGILL: syscall.SIGILL, gssh.SIGINT: syscall.SIGINT,
	gssh.SIGKILL: syscall.SIGKILL, gssh.SIGPIPE: syscall.SIGPIPE, gssh.SIGQUIT: syscall.SIGQUIT,
	gssh.SIGSEGV: syscall.SIGSEGV, gssh.SIGTERM: syscall.SIGTERM, gssh.SIGUSR1: syscall.SIGUSR1,
	gssh.SIGUSR2: syscall.SIGUSR2,
}

// agentSocket serves the client's agent on a socket only the login user
// can use.
func (s *Server) agentSocket(sess gssh.Session, login account.Login) (string, func(), error) {
	dir, err := os.MkdirTemp("", "tandem-agent-")
	if err != nil {
		return "", nil, err
	}
	sock := filepath.Join(dir, "agent.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		os.RemoveAll(dir)
		return "", nil, err
	}
	if s.cfg.CanSetUser {
		_ = os.Chown(dir, login.UID, login.GID)
		_ = os.Chown(sock, login.UID, login.GID)
	}
	_ = os.Chmod(dir, 0o700)
	go gssh.ForwardAgentConnections(l, sess)
	return sock, func() { l.Close(); os.RemoveAll(dir) }, nil
}

// sftp serves the sftp subsystem from a child process running as the login
// user (the runner re-executed as `sftp-server`), so file access is the
// user's, never root's on their behalf.
func (s *Server) sftp(sess gssh.Session) {
	login, err := s.login(sess.Context())
	if err != nil {
		_ = sess.Exit(254)
		return
	}
	if noLogin(login.Shell) || s.grant(sess.Context()).hasCommand {
		s.session(sess) // refused, or the forced command runs instead
		return
	}
	spec := ptyproc.Spec{Path: s.cfg.Self, Args: []string{s.cfg.Self, "sftp-server"},
		Env: []string{"HOME=" + login.Home}, Dir: homeOrRoot(login)}
	code, err := s.run(sess, spec, login)
	if err != nil {
		s.cfg.Log.Warn("sftp", "user", sess.User(), "err", err)
	}
	_ = sess.Exit(code)
}
