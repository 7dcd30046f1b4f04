//go:build unix

// Package toolrun runs a program the agents do not trust to be brief: a
// vendor tool of a job's image, the host's hl-smi, sudo asking a directory
// server. Each run is bounded in time and output and leaves nothing
// behind: the program runs in a process group of its own, killed with its
// children when the run ends, however it ends.
package toolrun

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"syscall"
	"time"
)

// Bounds are what one run may take.
type Bounds struct {
	// Timeout ends the run, the group killed (ErrTimeout).
	Timeout time.Duration
	// Stdout is how many bytes of stdout are taken: the first write past
	// it kills the run (ErrOutput), so a flood is never read to its end.
	Stdout int
	// Stderr is how many bytes of stderr are kept for the caller's error;
	// the rest is dropped (0: none kept).
	Stderr int
	// WaitDelay is how long children of a program that ended may hold its
	// pipes before they are closed under them.
	WaitDelay time.Duration
	// Env is the program's environment (nil: this process's).
	Env []string
}

var (
	// ErrTimeout means the program ran past Bounds.Timeout.
	ErrTimeout = errors.New("ran past its time bound")
	// ErrOutput means the program printed past Bounds.Stdout.
	ErrOutput = errors.New("printed past its output bound")
)

// Run runs name with args within b, stdin /dev/null, and returns what it
// printed to stdout and the kept stderr. The error wraps exec.ErrNotFound
// (no such program), ErrTimeout, ErrOutput, or the program's
// *exec.ExitError. A program that exited 0 while a child of its kept its
// pipe open past WaitDelay has answered: its output is returned.
func Run(ctx context.Context, b Bounds, name string, args ...string) (stdout, stderr []byte, err error) {
	ctx, cancel := context.WithTimeout(ctx, b.Timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = b.Env
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = b.WaitDelay
	out := &capped{limit: b.Stdout, over: cancel}
	errOut := &kept{limit: b.Stderr}
	cmd.Stdout, cmd.Stderr = out, errOut
	if err := cmd.Start(); err != nil {
		return nil, nil, fmt.Errorf("start %s: %w", name, err)
	}
	err = cmd.Wait()
	if errors.Is(err, exec.ErrWaitDelay) {
		err = nil // it exited 0; the child holding the pipe is killed below
	}
	// Children it left behind go with it. Its group id stays its own
	// while any member lives, so this reaches no other process.
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	switch {
	case out.exceeded:
		return nil, errOut.buf.Bytes(), fmt.Errorf("%s %w (%d bytes)", name, ErrOutput, b.Stdout)
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		return nil, errOut.buf.Bytes(), fmt.Errorf("%s %w (%s)", name, ErrTimeout, b.Timeout)
	case err != nil:
		return nil, errOut.buf.Bytes(), fmt.Errorf("run %s: %w", name, err)
	}
	return out.buf.Bytes(), errOut.buf.Bytes(), nil
}

// capped keeps at most limit bytes; the first write past it calls over
// (which kills the run) and fails.
type capped struct {
	buf      bytes.Buffer
	limit    int
	over     func()
	exceeded bool
}

func (w *capped) Write(p []byte) (int, error) {
	if w.exceeded || w.buf.Len()+len(p) > w.limit {
		w.exceeded = true
		w.over()
		return 0, ErrOutput
	}
	return w.buf.Write(p)
}

// kept keeps the first limit bytes written and drops the rest.
type kept struct {
	buf   bytes.Buffer
	limit int
}

func (w *kept) Write(p []byte) (int, error) {
	if room := w.limit - w.buf.Len(); room > 0 {
		w.buf.Write(p[:min(len(p), room)])
	}
	return len(p), nil
}
