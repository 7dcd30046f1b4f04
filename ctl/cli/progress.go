package cli

import (
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/tandem-run/tandem/ctl"
)

// progressPrinter shows a run's events on w, a line each. Pull progress is
// redrawn in place on a terminal (unless several runs report at once) and
// printed every 5 s elsewhere. quiet shows only notices: stdout carries
// machine-readable output.
type progressPrinter struct {
	w          io.Writer
	tty, quiet bool

	mu       sync.Mutex // guards the fields below; events come from several goroutines
	redrawn  bool       // the last line was a redrawn pull line, not ended yet
	lastPull time.Time
}

func (p *progressPrinter) event(e ctl.Event) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.quiet && e.Kind != ctl.EventNotice {
		return
	}
	if e.Kind == ctl.EventPull {
		switch {
		case p.tty && !e.Concurrent:
			fmt.Fprintf(p.w, "\r\x1b[K%s", e)
			p.redrawn = true
		case time.Since(p.lastPull) >= 5*time.Second:
			fmt.Fprintln(p.w, e)
			p.lastPull = time.Now()
		}
		return
	}
	if p.redrawn {
		fmt.Fprintln(p.w)
		p.redrawn = false
	}
	fmt.Fprintln(p.w, e)
}
