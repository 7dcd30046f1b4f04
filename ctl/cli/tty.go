package cli

import (
	"io"
	"os"
	"os/signal"
	"sync"

	"golang.org/x/term"

	"github.com/tandem-run/tandem/api"
)

// defaultTermSize is a -t job's terminal size when this side has no
// terminal to read one from (stdout and stdin piped), as a VT100's.
func defaultTermSize() api.TermSize { return api.TermSize{Rows: 24, Cols: 80} }

// runTerminal is tandem run -t on this side: the terminal whose size the
// job's terminal takes and follows (none: the default size, never
// resized), and with -i the one put in raw mode while the job runs, so
// that keys reach the job as typed (Ctrl-C its SIGINT, not tandem's).
type runTerminal struct {
	sized int // the descriptor the size is read from; -1: none
	raw   int // the descriptor made raw (-it); -1: none

	mu    sync.Mutex // guards saved
	saved *term.State
}

// newRunTerminal is -t's terminal: the size is read from stdout, else
// stdin (the first that is a terminal); with -i stdin is made raw.
func newRunTerminal(in io.Reader, out io.Writer, interactive bool) *runTerminal {
	t := &runTerminal{sized: -1, raw: -1}
	for _, f := range []any{out, in} {
		if fd, ok := terminalFd(f); ok {
			t.sized = fd
			break
		}
	}
	if fd, ok := terminalFd(in); ok && interactive {
		t.raw = fd
	}
	return t
}

// terminalFd is f's descriptor when f is a terminal.
func terminalFd(f any) (int, bool) {
	file, ok := f.(*os.File)
	if !ok || file == nil || !term.IsTerminal(int(file.Fd())) {
		return -1, false
	}
	return int(file.Fd()), true
}

// inputIsTerminal says whether r, tandem's stdin, is a terminal.
func inputIsTerminal(r io.Reader) bool {
	_, ok := terminalFd(r)
	return ok
}

// size is the terminal's size now, in bounds; the default size when
// there is no terminal, or it has no size (a pty never sized says 0x0).
func (t *runTerminal) size() api.TermSize {
	if t.sized < 0 {
		return defaultTermSize()
	}
	cols, rows, err := term.GetSize(t.sized)
	s := api.TermSize{Rows: min(rows, api.MaxTermSide), Cols: min(cols, api.MaxTermSide)}
	if err != nil || s.Check() != nil {
		return defaultTermSize()
	}
	return s
}

// follow sends the terminal's size at each change of the window
// (SIGWINCH) until stop; a size not yet taken is replaced by the newer
// one. Nil without a terminal: nothing to follow.
func (t *runTerminal) follow() (sizes <-chan api.TermSize, stop func()) {
	if t.sized < 0 {
		return nil, func() {}
	}
	out := make(chan api.TermSize, 1)
	winch := make(chan os.Signal, 1)
	notifyResize(winch)
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-done:
				return
			case <-winch:
			}
			s := t.size()
			select {
			case <-out: // the older size, not sent yet
			default:
			}
			out <- s // the one sender: there is room now
		}
	})
	return out, func() {
		signal.Stop(winch)
		close(done)
		wg.Wait()
	}
}

// makeRaw puts the input terminal in raw mode (-it), once; restore undoes
// it. A terminal that refuses stays as it is: the keys then go line by
// line, and Ctrl-C is tandem's.
func (t *runTerminal) makeRaw() {
	if t.raw < 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.saved != nil {
		return
	}
	if st, err := term.MakeRaw(t.raw); err == nil {
		t.saved = st
	}
}

// restore gives the input terminal back its state from before makeRaw.
// Harmless twice, without makeRaw, and on nil (no -t).
func (t *runTerminal) restore() {
	if t == nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.saved != nil {
		_ = term.Restore(t.raw, t.saved)
		t.saved = nil
	}
}
