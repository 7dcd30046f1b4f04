package ctl

import "io"

// LineEnds writes a job's terminal output for a reader that is not a
// terminal (a pipe, a file): the pty's "\r\n" line ends become "\n", as
// `dstack logs` prints them. A lone "\r" (a progress bar) stays.
func LineEnds(w io.Writer) io.Writer { return &lineEnds{w: w} }

type lineEnds struct {
	w   io.Writer
	cr  bool   // the last write ended in "\r"
	buf []byte // reused for each write's output (at most a chunk)
}

func (l *lineEnds) Write(p []byte) (int, error) {
	out := l.buf[:0]
	switch {
	case cap(l.buf) >= len(p)+1:
	case len(p) < 1<<20:
		l.buf = make([]byte, 0, max(len(p)+1, 64<<10))
		out = l.buf
	default: // a rare large write is not kept
		out = make([]byte, 0, len(p)+1)
	}
	if l.cr && (len(p) == 0 || p[0] != '\n') {
		out = append(out, '\r')
	}
	l.cr = false
	for i, b := range p {
		if b != '\r' {
			out = append(out, b)
			continue
		}
		switch {
		case i+1 == len(p):
			l.cr = true // decided by the next write
		case p[i+1] != '\n':
			out = append(out, b)
		}
	}
	if _, err := l.w.Write(out); err != nil {
		return 0, err
	}
	return len(p), nil
}
