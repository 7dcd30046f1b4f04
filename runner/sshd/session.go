package sshd

import (
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/creack/pty"
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

func (s *Server) credential(login account.Login) *syscall.Credential {
	if !s.cfg.CanSetUser {
		return nil
	}
	groups := make([]uint32, 0, len(login.Groups))
	for _, g := range login.Groups {
		groups = append(groups, uint32(g))
	}
	return &syscall.Credential{Uid: uint32(login.UID), Gid: uint32(login.GID), Groups: groups}
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
		fmt.Fprintf(sess.Stderr(), "tandem: %v\r\n", err)
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
	var cmd *exec.Cmd
	if opts.hasCommand {
		// command= runs instead of whatever was asked (a shell, a command,
		// a subsystem); what was asked is in SSH_ORIGINAL_COMMAND.
		if raw := sess.RawCommand(); raw != "" {
			env = append(env, "SSH_ORIGINAL_COMMAND="+raw)
		}
		cmd = exec.Command(shellArgv[0], append(shellArgv[1:], "-c", opts.command)...)
	} else if raw := sess.RawCommand(); raw != "" {
		cmd = exec.Command(shellArgv[0], append(shellArgv[1:], "-c", raw)...)
	} else {
		cmd = exec.Command(shellArgv[0], append(shellArgv[1:], "-l")...)
		cmd.Args[0] = "-" + filepath.Base(shellArgv[0]) // a login shell
	}
	cmd.Env = env
	cmd.Dir = "/"
	if fi, err := os.Stat(login.Home); err == nil && fi.IsDir() {
		cmd.Dir = login.Home
	}
	code, err := s.run(sess, cmd, login)
	if err != nil {
		log.Warn("ssh session", "err", err)
		fmt.Fprintf(sess.Stderr(), "tandem: %v\r\n", err)
	}
	_ = sess.Exit(code)
}

// run executes cmd for the session (in a pty if one was requested) and
// returns its exit status.
func (s *Server) run(sess gssh.Session, cmd *exec.Cmd, login account.Login) (int, error) {
	sigs := make(chan gssh.Signal, 4)
	sess.Signals(sigs)
	defer sess.Signals(nil)
	ptyReq, winCh, isPty := sess.Pty()
	if isPty {
		cmd.Env = append(cmd.Env, "TERM="+ptyReq.Term)
		master, tty, err := pty.Open()
		if err != nil {
			return 255, fmt.Errorf("open pty: %w", err)
		}
		defer master.Close()
		_ = pty.Setsize(master, &pty.Winsize{Rows: uint16(ptyReq.Window.Height), Cols: uint16(ptyReq.Window.Width)})
		if s.cfg.CanSetUser {
			_ = tty.Chown(login.UID, login.GID)
		}
		cmd.Stdin, cmd.Stdout, cmd.Stderr = tty, tty, tty
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0, Credential: s.credential(login)}
		if err := cmd.Start(); err != nil {
			tty.Close()
			return 127, fmt.Errorf("start shell: %w", err)
		}
		tty.Close()
		go func() {
			for w := range winCh {
				_ = pty.Setsize(master, &pty.Winsize{Rows: uint16(w.Height), Cols: uint16(w.Width)})
			}
		}()
		go func() { _, _ = io.Copy(master, sess) }()
		out := make(chan struct{})
		reader := ptyio.NewReader(master)
		go func() { _, _ = io.Copy(sess, reader); close(out) }()
		code := s.wait(sess, cmd, sigs)
		reader.Plain() // the shell exited: its hang-up may come any moment
		<-out          // the terminal drained: every byte is sent before exit-status
		return code, nil
	}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return 255, err
	}
	cmd.Stdout, cmd.Stderr = sess, sess.Stderr()
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: s.credential(login)}
	if err := cmd.Start(); err != nil {
		return 127, fmt.Errorf("start: %w", err)
	}
	go func() {
		_, _ = io.Copy(stdin, sess)
		stdin.Close()
	}()
	return s.wait(sess, cmd, sigs), nil
}

// wait waits for cmd, forwarding the client's signals to its process group
// and hanging it up when the client goes away.
func (s *Server) wait(sess gssh.Session, cmd *exec.Cmd, sigs <-chan gssh.Signal) int {
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	pid := cmd.Process.Pid
	for {
		select {
		case err := <-done:
			return ptyproc.FromWait(err)
		case sig := <-sigs:
			if n, ok := signals[sig]; ok {
				_ = syscall.Kill(-pid, n)
			}
		case <-sess.Context().Done():
			_ = syscall.Kill(-pid, syscall.SIGHUP)
			return <-exitOf(done)
		}
	}
}

func exitOf(done <-chan error) <-chan int {
	c := make(chan int, 1)
	go func() { c <- ptyproc.FromWait(<-done) }()
	return c
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
	cmd := exec.Command(s.cfg.Self, "sftp-server")
	cmd.Env = []string{"HOME=" + login.Home}
	cmd.Dir = "/"
	if fi, err := os.Stat(login.Home); err == nil && fi.IsDir() {
		cmd.Dir = login.Home
	}
	code, err := s.run(sess, cmd, login)
	if err != nil {
		s.cfg.Log.Warn("sftp", "user", sess.User(), "err", err)
	}
	_ = sess.Exit(code)
}
