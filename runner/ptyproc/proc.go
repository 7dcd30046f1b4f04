package ptyproc

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"

	"github.com/creack/pty"
	"golang.org/x/sys/unix"

	"github.com/tandem-run/tandem/common/procs"
)

// Spec is a process to start.
type Spec struct {
	// Path is the program; a bare name is looked up in the runner's PATH.
	Path string
	// Args is the whole argv, Args[0] included (a login shell's "-sh").
	// Empty: Path alone.
	Args []string
	Env  []string
	Dir  string
	// Cred runs the process as another user; nil: as the runner.
	Cred *Cred
	// TTY gives the process a new session with a pseudo-terminal as its
	// stdin, stdout, stderr and controlling terminal (read and write it
	// with Terminal). Without it the process leads a new process group and
	// uses Stdin, Stdout and Stderr.
	TTY  bool
	Size *Size // the terminal's first size; nil: the kernel's default
	// Stdin is copied into the process until it ends or the process exits.
	// nil: /dev/null, or with TTY the terminal. With TTY a Stdin replaces
	// only fd 0: the terminal stays stdout, stderr and the controlling
	// terminal. Stdout and Stderr (without TTY only) nil: /dev/null.
	Stdin          io.Reader
	Stdout, Stderr io.Writer
	// ProcRoot is where SignalSession finds the session's processes
	// ("/proc" when empty).
	ProcRoot string
}

// Cred is a user to run as.
type Cred struct {
	UID, GID int
	Groups   []int
}

// Sys is c for exec's SysProcAttr; nil for nil (the runner's own user).
func (c *Cred) Sys() *syscall.Credential {
	if c == nil {
		return nil
	}
	groups := make([]uint32, 0, len(c.Groups))
	for _, g := range c.Groups {
		groups = append(groups, uint32(g))
	}
	return &syscall.Credential{Uid: uint32(c.UID), Gid: uint32(c.GID), Groups: groups}
}

// Size is a terminal's size in characters.
type Size struct{ Rows, Cols uint16 }

// StartError is a process that could not start, with the status a shell
// reports for it: 127 for a program not found, 126 for one that cannot run.
type StartError struct {
	Code int
	Err  error
}

func (e *StartError) Error() string { return e.Err.Error() }
func (e *StartError) Unwrap() error { return e.Err }

// Proc is a started process.
type Proc struct {
	cmd      *exec.Cmd
	master   *os.File // nil without a terminal
	procRoot string
	exited   chan struct{}
	waitErr  error // cmd.Wait's, once exited is closed

	closeOnce sync.Once
}

// Start starts the process as spec says.
func Start(spec Spec) (*Proc, error) {
	path := spec.Path
	if filepath.Base(path) == path {
		if p, err := exec.LookPath(path); err == nil {
			path = p
		}
	}
	cmd := exec.Command(path)
	if len(spec.Args) > 0 {
		cmd.Args = spec.Args
	} else {
		cmd.Args = []string{spec.Path}
	}
	cmd.Env, cmd.Dir = spec.Env, spec.Dir
	attr := &syscall.SysProcAttr{Credential: spec.Cred.Sys()}
	cmd.SysProcAttr = attr
	p := &Proc{cmd: cmd, procRoot: spec.ProcRoot, exited: make(chan struct{})}
	if p.procRoot == "" {
		p.procRoot = "/proc"
	}
	var tty *os.File
	var stdin io.WriteCloser
	if spec.TTY {
		master, t, err := pty.Open()
		if err != nil {
			return nil, fmt.Errorf("open pty: %w", err)
		}
		p.master, tty = master, t
		// pty.Open took the master's descriptor with Fd, which left it
		// blocking: make it non-blocking again (see control).
		if err := p.control(func(fd int) error { return unix.SetNonblock(fd, true) }); err != nil {
			master.Close()
			t.Close()
			return nil, fmt.Errorf("pty: %w", err)
		}
		if spec.Size != nil {
			_ = p.Resize(*spec.Size)
		}
		if c := spec.Cred; c != nil {
			_ = tty.Chown(c.UID, c.GID)
		}
		cmd.Stdin, cmd.Stdout, cmd.Stderr = tty, tty, tty
		// Ctty names a descriptor of the child's: stdout is the terminal
		// whatever stdin is.
		attr.Setsid, attr.Setctty, attr.Ctty = true, true, 1
	} else {
		cmd.Stdout, cmd.Stderr = spec.Stdout, spec.Stderr
		attr.Setpgid = true
	}
	// A pipe, copied by us rather than by exec: exec's own copy would make
	// Wait wait for the reader's end (an SSH client that never closes its
	// stdin).
	if spec.Stdin != nil {
		cmd.Stdin = nil
		w, err := cmd.StdinPipe()
		if err != nil {
			p.Close()
			if tty != nil {
				tty.Close()
			}
			return nil, err
		}
		stdin = w
	}
	err := cmd.Start()
	if tty != nil {
		tty.Close() // the child has its own; a hang-up reaches the master once it exits
	}
	if err != nil {
		p.Close()
		code := 126
		if errors.Is(err, exec.ErrNotFound) || errors.Is(err, fs.ErrNotExist) {
			code = 127
		}
		return nil, &StartError{Code: code, Err: fmt.Errorf("start %s: %w", spec.Path, err)}
	}
	if stdin != nil {
		go func() {
			_, _ = io.Copy(stdin, spec.Stdin)
			stdin.Close()
		}()
	}
	go func() {
		p.waitErr = cmd.Wait()
		close(p.exited)
	}()
	return p, nil
}

// Pid is the process's id; it also names its process group, and with a
// terminal its session.
func (p *Proc) Pid() int { return p.cmd.Process.Pid }

// Terminal is the master side of the process's terminal (nil without TTY):
// its output is read there and its input written there. Reads after the
// process and its session are gone fail with EIO (see ptyio).
func (p *Proc) Terminal() *os.File { return p.master }

// Resize sets the terminal's size.
func (p *Proc) Resize(s Size) error {
	if p.master == nil {
		return errors.New("no terminal")
	}
	return p.control(func(fd int) error {
		return unix.IoctlSetWinsize(fd, unix.TIOCSWINSZ, &unix.Winsize{Row: s.Rows, Col: s.Cols})
	})
}

// Signal sends sig to the process's group (its job control group: with a
// terminal, the session leader's; a foreground job it started has its own).
func (p *Proc) Signal(sig syscall.Signal) error { return syscall.Kill(-p.Pid(), sig) }

// HangUp tells the process group its terminal or client is gone (SIGHUP).
func (p *Proc) HangUp() error { return p.Signal(syscall.SIGHUP) }

// SignalSession sends sig to every process of the process's session, found
// in /proc (a job's background groups included); it returns how many it
// reached. Meaningful with TTY, where the process leads its session.
func (p *Proc) SignalSession(sig syscall.Signal) int {
	n := 0
	for _, pid := range SessionMembers(p.procRoot, p.Pid()) {
		if syscall.Kill(pid, sig) == nil {
			n++
		}
	}
	return n
}

// Exited is closed once the process has exited and been reaped.
func (p *Proc) Exited() <-chan struct{} { return p.exited }

// Wait waits for the process to exit and returns its status as a shell
// reports it (ExitStatus).
func (p *Proc) Wait() (code int, killedBy syscall.Signal) {
	<-p.exited
	if p.cmd.ProcessState == nil {
		return FromWait(p.waitErr), 0
	}
	return ExitStatus(p.cmd.ProcessState)
}

// Close releases the terminal's master. Idempotent.
func (p *Proc) Close() {
	p.closeOnce.Do(func() {
		if p.master != nil {
			p.master.Close()
		}
	})
}

// SessionMembers lists the pids whose session id is sid, read from
// procRoot's <pid>/stat files.
func SessionMembers(procRoot string, sid int) []int {
	entries, err := os.ReadDir(procRoot)
	if err != nil {
		return nil
	}
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		// state ppid pgrp session ...
		f, err := procs.StatFields(filepath.Join(procRoot, e.Name()))
		if err != nil || len(f) < 4 {
			continue
		}
		if sess, err := strconv.Atoi(f[3]); err == nil && sess == sid {
			pids = append(pids, pid)
		}
	}
	return pids
}
