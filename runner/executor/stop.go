package executor

// How a job's process ends: the stop sequence a person at the terminal
// would follow, and the drain of its output once it exited.

import (
	"bytes"
	"sync"
	"syscall"
	"time"

	"github.com/tandem-run/tandem/runner/ptyproc"
)

// drain waits for the job's output to end once its main process exited.
// Leftovers holding the terminal must not keep the job alive: they are
// hung up, then killed if they linger, and at last the terminal is closed.
func (x *Executor) drain(proc *ptyproc.Proc, readDone <-chan struct{}) {
	select {
	case <-readDone:
		return
	case <-time.After(x.cfg.DrainGrace / 2):
	}
	proc.SignalSession(syscall.SIGHUP)
	proc.SignalSession(syscall.SIGTERM)
	select {
	case <-readDone:
		return
	case <-time.After(x.cfg.DrainGrace / 2):
	}
	proc.SignalSession(syscall.SIGKILL)
	// Nothing writes any more: what the terminal still holds is read
	// without waiting for the log's reader (the log's bound keeps what that
	// reader has not had; the file grows by this remainder).
	x.journal.ReleaseOutput()
	select {
	case <-readDone:
	case <-time.After(time.Second):
		proc.Close()
		<-readDone
	}
}

// stopSequence stops the job like a person at the terminal would, then
// harder: Ctrl-C (the terminal's INTR character reaches the foreground
// process group, even under an interactive shell); then SIGTERM and SIGHUP
// to the whole session, then SIGKILL.
//
// An interactive shell (`sh -i -c "a && sleep 300 && b"`, how the dstack
// server runs jobs) survives Ctrl-C: the foreground job dies, the shell
// takes the terminal back and waits at a prompt until the escalation. So
// when a job had the terminal and the shell, the session leader, takes it
// back, the session is hung up at once and nothing the shell wrote after
// that moment (its prompt) is kept. A foreground program that handles
// SIGINT itself keeps the terminal, and so its full grace.
func (x *Executor) stopSequence(proc *ptyproc.Proc, cut *outputCut) {
	sid, exited := proc.Pid(), proc.Exited()
	fg0, err := proc.ForegroundGroup()
	jobHadTerminal := err == nil && fg0 > 0 && fg0 != sid
	if jobHadTerminal {
		cut.stopping()
	}
	x.runnerLog.Info("Stopping job: Ctrl-C", "session", sid, "foreground", fg0)
	_ = proc.Interrupt()
	grace := time.After(x.cfg.InterruptGrace)
	poll := time.NewTicker(time.Millisecond)
	defer poll.Stop()
	for waiting := true; waiting; {
		select {
		case <-exited:
			return
		case <-grace:
			waiting = false
		case <-poll.C:
			if !jobHadTerminal {
				continue
			}
			if fg, err := proc.ForegroundGroup(); err == nil && fg == sid {
				// The shell has the terminal again: keep what was
				// written until now, then hang up.
				pending, _ := proc.Unread()
				cut.at(pending)
				proc.SignalSession(syscall.SIGHUP)
				proc.SignalSession(syscall.SIGCONT)
				x.runnerLog.Info("Stopping job: the shell took the terminal back, hung up")
				waiting = false
			}
		}
	}
	x.runnerLog.Info("Stopping job: SIGTERM and SIGHUP to the session")
	proc.SignalSession(syscall.SIGTERM)
	proc.SignalSession(syscall.SIGHUP)
	select {
	case <-exited:
		return
	case <-time.After(x.cfg.KillGrace):
	}
	x.runnerLog.Info("Stopping job: SIGKILL to the session")
	proc.SignalSession(syscall.SIGKILL)
	<-exited
}

// outputCut drops what an interactive shell writes once it took the
// terminal back on a stop: its prompt. From the Ctrl-C on, output passes a
// line at a time (a partial last line is held back until its newline);
// when the cut comes, bytes read after it and the held partial line (the
// prompt has no newline) are dropped. Safe for the reader and the stop
// sequence together.
type outputCut struct {
	mu       sync.Mutex // guards the fields below
	holding  bool       // a stop began: hold partial lines
	read     int64      // bytes the reader has taken from the terminal
	limit    int64      // keep bytes before this offset; 0: no cut yet
	held     []byte     // partial line held back
	cutTaken bool
	// firstAfter: no read was accounted since the cut. The reader may have
	// taken a chunk from the terminal just before the cut was measured
	// and not accounted it yet (it was neither read nor pending then): the
	// complete lines of the first chunk past the limit are kept, and only
	// its partial last line (a prompt) goes.
	firstAfter bool
}

func (c *outputCut) stopping() {
	c.mu.Lock()
	c.holding = true
	c.mu.Unlock()
}

// pass accounts p just read and returns what may be delivered now.
func (c *outputCut) pass(p []byte) []byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	start := c.read
	c.read += int64(len(p))
	if c.cutTaken {
		if c.firstAfter {
			if i := bytes.LastIndexByte(p, '\n'); i >= 0 && start+int64(i)+1 > c.limit {
				c.limit = start + int64(i) + 1
			}
		}
		c.firstAfter = false
		if keep := c.limit - start; keep < int64(len(p)) {
			p = p[:max(0, keep)]
		}
	}
	if !c.holding {
		return p
	}
	data := append(c.held, p...)
	i := bytes.LastIndexByte(data, '\n')
	c.held = append([]byte(nil), data[i+1:]...)
	return data[:i+1]
}

// rest is the held partial line at the end of output: kept unless the
// stop cut it (it is then the shell's prompt).
func (c *outputCut) rest() []byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cutTaken {
		return nil
	}
	return c.held
}

// at cuts after what was read so far plus pending bytes still in the
// terminal's buffer.
func (c *outputCut) at(pending int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.limit, c.cutTaken, c.firstAfter = c.read+int64(max(pending, 0)), true, true
}
