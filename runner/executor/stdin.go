package executor

import (
	"errors"
	"fmt"
	"io"

	"github.com/tandem-run/tandem/api"
)

// stdinFeed is a job's stream from its client (api.StdinPath): with
// api.StdinStream its standard input, which one feeder writes and the job
// reads, and for a job given a terminal size (api.SubmitExtras.TTY) its
// resizes, with or without input. Nothing is buffered beyond the pipe's
// hand-over: a feeder waits while the job does not read.
type stdinFeed struct {
	r     *io.PipeReader // nil: the job reads no input from the stream
	w     *io.PipeWriter
	taken bool // a feeder has the stream; guarded by the executor's mu
}

func newStdinFeed(input bool) *stdinFeed {
	if !input {
		return &stdinFeed{}
	}
	r, w := io.Pipe()
	return &stdinFeed{r: r, w: w}
}

// ErrStdinOver ends a stdin feeder's writes once the job no longer reads
// them: it ended, or will never start.
var ErrStdinOver = errors.New("the job no longer reads its stdin")

// end unblocks the feeder, for good: the job ended, or will never start.
func (f *stdinFeed) end() {
	if f.r != nil {
		f.r.CloseWithError(ErrStdinOver)
	}
}

// stdinMode checks a submit's stdin mode.
func stdinMode(b api.SubmitBody) (string, error) {
	if b.Tandem == nil {
		return "", nil
	}
	switch m := b.Tandem.Stdin; m {
	case "", api.StdinNone, api.StdinStream:
		return m, nil
	default:
		return "", fmt.Errorf(`%w: tandem.stdin "%s" is not a mode: %q, %q, or no field for the job's terminal`,
			ErrBadInput, api.Printable(m), api.StdinNone, api.StdinStream)
	}
}

// TakeStdin hands the job's stream (api.StdinPath) to its one feeder,
// from the submit until the job ends: w is its streamed stdin
// (api.StdinStream), nil for a job that reads none from it (a TTY job's
// stream carries only its resizes: Resize). Closing the writer ends the
// job's input (it reads end of file); writes fail with ErrStdinOver once
// the job ended. A feeder that wrote nothing may give the stream back
// instead (release): the next one takes it.
func (x *Executor) TakeStdin() (w io.WriteCloser, release func(), err error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	f := x.stdin
	switch {
	case f == nil:
		return nil, nil, fmt.Errorf("%w: the job was submitted with neither a streamed stdin (tandem.stdin %q) nor a terminal size (tandem.tty)", ErrState, api.StdinStream)
	case x.state != WaitRun && x.state != ServeLogs:
		return nil, nil, fmt.Errorf("%w: stdin in state %s", ErrState, x.state)
	case f.taken:
		return nil, nil, fmt.Errorf("%w: the job's stdin has its feeder already (one per job)", ErrState)
	}
	f.taken = true
	release = func() {
		x.mu.Lock()
		f.taken = false
		x.mu.Unlock()
	}
	if f.w == nil {
		return nil, release, nil // not f.w: a nil *io.PipeWriter is a non-nil io.WriteCloser
	}
	return f.w, release, nil
}

// stdinFor is what the job reads on fd 0 (nil: its terminal).
func (x *Executor) stdinFor(mode string) io.Reader {
	switch mode {
	case api.StdinNone:
		return eofReader{}
	case api.StdinStream:
		x.mu.Lock()
		defer x.mu.Unlock()
		if x.stdin != nil && x.stdin.r != nil {
			return x.stdin.r
		}
	}
	return nil
}

// endStdinLocked ends the streamed stdin, if any. x.mu is held.
func (x *Executor) endStdinLocked() {
	if x.stdin != nil {
		x.stdin.end()
	}
}

// eofReader is an input that ends at once, as docker run gives without -i.
type eofReader struct{}

func (eofReader) Read([]byte) (int, error) { return 0, io.EOF }
