package cli

import (
	"fmt"
	"io"
	"strings"
	"sync"
	"time"

	"github.com/tandem-run/tandem/ctl"
)

// progressPrinter shows a run's events on w, a line each. Pull progress is
// redrawn in place on a terminal (unless several runs report at once) and
// printed every 5 s elsewhere. quiet shows only what the user must read (a
// task left behind, the answer to a Ctrl-C): -q, stdout carries
// machine-readable output, or no one watches stderr.
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
	if p.quiet && e.Kind != ctl.EventTaskLeft && e.Kind != ctl.EventStopping {
		return
	}
	if e.Kind == ctl.EventPull {
		switch {
		case p.tty && !e.Concurrent:
			fmt.Fprintf(p.w, "\r\x1b[K%s", render(e))
			p.redrawn = true
		case time.Since(p.lastPull) >= 5*time.Second:
			fmt.Fprintln(p.w, render(e))
			p.lastPull = time.Now()
		}
		return
	}
	if p.redrawn {
		fmt.Fprintln(p.w)
		p.redrawn = false
	}
	fmt.Fprintln(p.w, render(e))
}

// render is an event as one line of text (two for a task left behind: how
// to remove it).
func render(e ctl.Event) string {
	switch e.Kind {
	case ctl.EventPhaseDone:
		return fmt.Sprintf("task %s: %s done in %.2fs", e.Task, e.Status, e.Took.Seconds())
	case ctl.EventReady:
		return fmt.Sprintf("task %s: %s after %.2fs", e.Task, e.Status, e.Took.Seconds())
	case ctl.EventPull:
		if e.Pull == nil {
			return "  pulling " + e.Image
		}
		return fmt.Sprintf("  pulling %s: %s", e.Image, progressBar(e.Pull.DownloadedBytes, e.Pull.TotalBytes, e.Pull.IsTotalBytesFinal))
	case ctl.EventStopping:
		return e.Text + " (Ctrl-C again to kill it)"
	case ctl.EventTaskLeft:
		node := ""
		if e.Node != "" {
			node = e.Node + ": "
		}
		return fmt.Sprintf("tandem: %stask %s was left on the shim: %v\nremove it with: tandem rm -f --shim %s %s", node, e.Task, e.Err, e.Shim, e.Name)
	}
	return e.Text
}

// progressBar draws done/total as 24 cells and MiB; "+" while the total
// may still grow.
func progressBar(done, total int64, final bool) string {
	const width = 24
	n := int(float64(width) * float64(done) / float64(max(total, 1)))
	n = min(max(n, 0), width)
	suffix := ""
	if !final {
		suffix = "+"
	}
	return fmt.Sprintf("[%s%s] %d/%d%s MiB", strings.Repeat("#", n), strings.Repeat("-", width-n), done>>20, total>>20, suffix)
}
