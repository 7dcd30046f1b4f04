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

// side is one writer to the shared stream: the job's output (job), which
// notes whether its last byte ended a line, or tandem's own lines, each of
// which starts on a line of its own.
type side struct {
	w   io.Writer
	l   *openLine
	job bool
}

func (s side) Write(p []byte) (int, error) {
	s.l.mu.Lock()
	defer s.l.mu.Unlock()
	if !s.job && s.l.open && len(p) > 0 {
		if _, err := s.w.Write([]byte("\n")); err != nil {
			return 0, err
		}
		s.l.open = false
	}
	n, err := s.w.Write(p)
	if s.job && n > 0 {
		s.l.open = p[n-1] != '\n'
	}
	return n, err
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
	c.App.ErrWriter = side{c.App.ErrWriter, l, false}
	return side{out, l, true}
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
