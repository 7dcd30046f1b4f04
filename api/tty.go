package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// TermSize is a job's terminal size in characters (docker run -t): the
// size at its start (SubmitExtras.TTY) and each later one (a StdinControl
// resize).
type TermSize struct {
	Rows int `json:"rows"`
	Cols int `json:"cols"`
}

// MaxTermSide bounds a terminal's rows and its columns: a size past it is
// no screen's (the largest monitors' finest fonts stay far below), and the
// kernel keeps the size in 16 bits.
const MaxTermSide = 10000

// ErrBadTermSize is a terminal size out of bounds.
var ErrBadTermSize = errors.New("bad terminal size")

// Check refuses a size whose rows or columns are not 1..MaxTermSide.
func (s TermSize) Check() error {
	if s.Rows < 1 || s.Rows > MaxTermSide || s.Cols < 1 || s.Cols > MaxTermSide {
		return fmt.Errorf("%w: %d rows, %d columns: want 1..%d each", ErrBadTermSize, s.Rows, s.Cols, MaxTermSide)
	}
	return nil
}

// MaxStdinControl is the most one control message on StdinPath may hold:
// a resize takes about 40 bytes.
const MaxStdinControl = 1 << 10

// StdinControl is a text message on StdinPath (the stream's binary
// messages are the job's input): a Tandem client's word about the job's
// terminal. Resize is the only one today.
type StdinControl struct {
	// Resize is the terminal's new size (the client's window changed:
	// SIGWINCH); the job's foreground group gets SIGWINCH from the kernel.
	Resize *TermSize `json:"resize,omitempty"`
}

// ErrBadStdinControl is a control message that cannot be read.
var ErrBadStdinControl = errors.New("bad control message")

// ParseStdinControl reads one control message: at most MaxStdinControl
// bytes of one JSON object with known fields only, that says something,
// with a size in bounds.
func ParseStdinControl(b []byte) (StdinControl, error) {
	var c StdinControl
	if len(b) > MaxStdinControl {
		return c, fmt.Errorf("%w: %d bytes, the most is %d", ErrBadStdinControl, len(b), MaxStdinControl)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return StdinControl{}, fmt.Errorf("%w: %v", ErrBadStdinControl, err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return StdinControl{}, fmt.Errorf("%w: more than one JSON object", ErrBadStdinControl)
	}
	if c.Resize == nil {
		return StdinControl{}, fmt.Errorf(`%w: want {"resize":{"rows":R,"cols":C}}`, ErrBadStdinControl)
	}
	if err := c.Resize.Check(); err != nil {
		return StdinControl{}, fmt.Errorf("%w: resize: %w", ErrBadStdinControl, err)
	}
	return c, nil
}
