package executor

import (
	"fmt"
	"io"
	"os"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/runner/ptyproc"
)

// jobTerm is the job's terminal size as its client last asked (docker run
// -t: the size at the submit, then each resize), and the job's process
// once it runs, whose terminal takes each new size at once. Guarded by the
// executor's mu.
type jobTerm struct {
	size *ptyproc.Size // nil: the kernel's default
	proc *ptyproc.Proc // the running job's; nil before its start and after its end
}

// termSize checks a submit's terminal size (api.SubmitExtras.TTY); nil
// when it has none.
func termSize(b api.SubmitBody) (*ptyproc.Size, error) {
	if b.Tandem == nil || b.Tandem.TTY == nil {
		return nil, nil
	}
	s, err := ptySize(*b.Tandem.TTY)
	if err != nil {
		return nil, fmt.Errorf("%w: tandem.tty: %w", ErrBadInput, err)
	}
	return &s, nil
}

// ptySize is s as the terminal's, once in bounds (api.TermSize.Check:
// they fit 16 bits).
func ptySize(s api.TermSize) (ptyproc.Size, error) {
	if err := s.Check(); err != nil {
		return ptyproc.Size{}, err
	}
	return ptyproc.Size{Rows: uint16(s.Rows), Cols: uint16(s.Cols)}, nil
}

// Resize sets the job's terminal size (a resize on its stream): at once
// when the job runs (the kernel sends its foreground group SIGWINCH),
// else at its start. A job submitted without a size has a terminal all
// the same, which takes it.
func (x *Executor) Resize(s api.TermSize) error {
	size, err := ptySize(s)
	if err != nil {
		return fmt.Errorf("%w: resize: %w", ErrBadInput, err)
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.state != WaitRun && x.state != ServeLogs {
		return fmt.Errorf("%w: resize in state %s", ErrState, x.state)
	}
	x.term.size = &size
	if p := x.term.proc; p != nil {
		// An ioctl: it does not block, so it is made under the lock, which
		// orders it with attachTerm's.
		if err := p.Resize(size); err != nil {
			return fmt.Errorf("resize the job's terminal: %w", err)
		}
	}
	return nil
}

// startSize is the size the job's terminal starts with.
func (x *Executor) startSize() *ptyproc.Size {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.term.size
}

// attachTerm sends the job's later resizes to p's terminal, until the
// returned detach. A resize that came between startSize and now is
// applied here.
func (x *Executor) attachTerm(p *ptyproc.Proc) (detach func()) {
	x.mu.Lock()
	x.term.proc = p
	if s := x.term.size; s != nil {
		_ = p.Resize(*s)
	}
	x.mu.Unlock()
	return func() {
		x.mu.Lock()
		x.term.proc = nil
		x.mu.Unlock()
	}
}

// keysFor is the job's streamed input when it is typed at the job's
// terminal rather than piped to its fd 0: a job with a terminal size and
// a streamed stdin (docker run -it), whose keys the terminal's line
// discipline reads as a person's (Ctrl-C is SIGINT, the echo is the
// terminal's). nil otherwise.
func (x *Executor) keysFor(b api.SubmitBody) io.Reader {
	if b.Tandem == nil || b.Tandem.TTY == nil || b.Tandem.Stdin != api.StdinStream {
		return nil
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.stdin == nil || x.stdin.r == nil {
		return nil
	}
	return x.stdin.r
}

// typeKeys writes keys to the terminal's master until they end (the
// client closed its stream: a terminal has no end of file to give) or the
// terminal is gone. A job that reads nothing fills the terminal's input
// queue, and the writes wait: the client's stream waits with them.
func typeKeys(keys io.Reader, master *os.File) {
	_, err := io.Copy(master, keys)
	if pr, ok := keys.(*io.PipeReader); ok && err != nil {
		_ = pr.CloseWithError(ErrStdinOver) // its feeder is told, not left waiting
	}
}
