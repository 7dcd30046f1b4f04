package cli

import (
	"io"
	"os"
	"sync"

	"github.com/urfave/cli/v2"
)

// openLine is whether the job's output left a line unended on the stream
// that tandem's own lines (stderr) share: a job that ends with
// `printf abc`, or with a progress bar's \r, had "job done" or "tandem:
// job failed" written onto its last line.
type openLine struct {
	mu   sync.Mutex
	open bool
}

// jobSide is the job's output: it notes whether its last byte ended a
// line.
type jobSide struct {
	w io.Writer
	l *openLine
}

func (j jobSide) Write(p []byte) (int, error) {
	j.l.mu.Lock()
	defer j.l.mu.Unlock()
	n, err := j.w.Write(p)
	if n > 0 {
		j.l.open = p[n-1] != '\n'
	}
	return n, err
}

// ownSide is tandem's own lines: each starts on a line of its own.
type ownSide struct {
	w io.Writer
	l *openLine
}

func (o ownSide) Write(p []byte) (int, error) {
	o.l.mu.Lock()
	defer o.l.mu.Unlock()
	if o.l.open && len(p) > 0 {
		if _, err := o.w.Write([]byte("\n")); err != nil {
			return 0, err
		}
		o.l.open = false
	}
	return o.w.Write(p)
}

// shareLines makes tandem's own lines (c.App.ErrWriter, from here on)
// start on a line of their own after job output written to out, when both
// reach the same terminal, pipe or file (shared says so; else out is
// returned as it is).
func shareLines(c *cli.Context, out io.Writer, shared bool) io.Writer {
	if !shared {
		return out
	}
	l := &openLine{}
	c.App.ErrWriter = ownSide{c.App.ErrWriter, l}
	return jobSide{out, l}
}

// sameStream says whether the app's stdout and stderr are one terminal,
// pipe or file (2>&1, or both on the terminal).
func sameStream(c *cli.Context) bool {
	o, ok1 := c.App.Writer.(*os.File)
	e, ok2 := c.App.ErrWriter.(*os.File)
	if !ok1 || !ok2 {
		return false
	}
	oi, err1 := o.Stat()
	ei, err2 := e.Stat()
	return err1 == nil && err2 == nil && os.SameFile(oi, ei)
}
