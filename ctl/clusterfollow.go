package ctl

// Following a multi-node run: every node's job to its end, the first
// failure stopping the rest, a node's death told from a pause.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"time"

	"github.com/tandem-run/tandem/api"
)

// nodeEnd is how one node's job ended.
type nodeEnd struct {
	node *clusterNode
	res  Result
	err  error // the node died: its runner or task is gone
}

// followCluster streams the master's output (and the workers', prefixed)
// and waits for the run's end: the master's, a worker's failure, or the
// caller's Stop (every job is stopped) or ctx ending (every node is killed).
func followCluster(ctx context.Context, c *Client, cs []*clusterNode, stops <-chan struct{}, o RunOptions, res Result) (Result, bool) {
	wctx, stopWatching := context.WithCancel(ctx)
	defer stopWatching()
	ends := make(chan nodeEnd, len(cs))
	var outMu sync.Mutex
	for _, n := range cs {
		out := io.Writer(&lockedWriter{mu: &outMu, w: o.Out})
		var pw *prefixWriter
		if n.rank > 0 {
			pw = &prefixWriter{prefix: fmt.Sprintf("[node %d] ", n.rank), w: &lockedWriter{mu: &outMu, w: o.workerOut()}}
			out = pw
		}
		go func() {
			var r Result
			err := watchNode(wctx, c.clk, n, out, &r)
			if pw != nil {
				pw.flush()
			}
			ends <- nodeEnd{node: n, res: r, err: err}
		}()
	}
	stopAll := func(why string) {
		if why == "" {
			c.say.emit(Event{Kind: EventStopping, Text: "interrupted: stopping every node"})
		} else {
			c.say.status("%s: stopping every node", why)
		}
		_ = onEach(cs, func(n *clusterNode) error { return n.runner.Stop(context.WithoutCancel(ctx)) })
	}
	pending := len(cs)
	var first *nodeEnd // what decided the run
	var settle <-chan time.Time
	for pending > 0 {
		select {
		case e := <-ends:
			pending--
			switch {
			case first != nil:
			case res.Interrupted: // the user's stop: every node ends now
			case e.node.rank == 0 && e.err == nil:
				first = &e
				if pending > 0 {
					stopAll(fmt.Sprintf("the master's job %s", strings.TrimPrefix(Describe(e.res), "job ")))
					settle = c.clk.After(30 * time.Second)
				}
			case e.err == nil && e.res.State == api.JobDone:
				c.say.status("%s: job done", e.node)
			default:
				first = &e
				if pending > 0 {
					stopAll(fmt.Sprintf("%s %s", e.node, nodeFailure(e)))
					settle = c.clk.After(30 * time.Second)
				}
			}
		case <-stops:
			if !res.Interrupted {
				res.Interrupted = true
				stopAll("")
				settle = c.clk.After(30 * time.Second)
			}
		case <-ctx.Done():
			c.say.status("killing every node")
			res.State, res.Interrupted = api.JobTerminated, true
			return res, true
		case <-settle:
			c.say.status("%d node(s) did not stop in 30s; ending their tasks", pending)
			pending = 0
		}
	}
	if first == nil { // interrupted and every node stopped
		res.State = api.JobTerminated
		return res, false
	}
	e := *first
	if e.node.rank == 0 && e.err == nil {
		r := e.res
		r.TaskID, r.Name, r.Interrupted = res.TaskID, res.Name, res.Interrupted
		return r, false
	}
	res.State, res.Reason = api.JobFailed, e.res.Reason
	if e.res.ExitStatus != nil && *e.res.ExitStatus != 0 {
		res.ExitStatus = e.res.ExitStatus
	}
	res.Message = fmt.Sprintf("%s %s; the other nodes were stopped", e.node, nodeFailure(e))
	return res, false
}

// nodeFailure says how a node's job ended, for the run's message.
func nodeFailure(e nodeEnd) string {
	if e.err != nil {
		return "died: " + e.err.Error()
	}
	return "ended first: " + Describe(e.res)
}

// watchNode follows one node's job to its end. When its runner stops
// answering, the node's shim is asked for up to nodeGrace: a task that is
// gone or terminated is the node's death (with the shim's reason); a
// runner that answers again is followed on.
func watchNode(ctx context.Context, clk Clock, n *clusterNode, out io.Writer, res *Result) error {
	since := time.Time{}
	for {
		err := pullWatch(clk, n.runner, since, out).run(ctx, res)
		if err == nil || ctx.Err() != nil {
			return err
		}
		since = clockOr(clk).Now()
		if derr := nodeFate(ctx, clk, n, err); derr != nil {
			return derr
		}
	}
}

// nodeGrace is how long a node's runner may stay silent while its task
// still runs.
const nodeGrace = 15 * time.Second

// nodeFate decides whether a node whose runner failed (runnerErr) is dead:
// nil when its runner answers again.
func nodeFate(ctx context.Context, clk Clock, n *clusterNode, runnerErr error) error {
	status := "unknown"
	err := poll(ctx, clk, 500*time.Millisecond, nodeGrace, func() (bool, error) {
		info, err := n.c.shim.GetTask(ctx, n.id)
		switch {
		case errors.Is(err, api.ErrNotFound):
			return true, errors.New("its task was removed")
		case err == nil && info.Status == api.TaskTerminated:
			return true, fmt.Errorf("its task was terminated: %s%s", api.Printable(string(info.TerminationReason)), lastLine(info.TerminationMessage))
		case err == nil:
			status = string(info.Status)
		}
		if _, herr := n.runner.Healthcheck(ctx); herr == nil {
			return true, nil
		}
		return false, nil
	})
	if errors.Is(err, errWaitedOut) {
		return fmt.Errorf("its runner stopped answering %s ago (%v); its task is %s", nodeGrace, runnerErr, api.Printable(status))
	}
	return err
}

// lastLine is ": " and the last line of a termination message (the
// container's last output), at most 200 bytes, or "".
func lastLine(msg string) string {
	msg = strings.TrimSpace(msg)
	if i := strings.LastIndexByte(msg, '\n'); i >= 0 {
		msg = msg[i+1:]
	}
	if msg == "" {
		return ""
	}
	if len(msg) > 200 {
		msg = msg[len(msg)-200:]
	}
	return ": " + api.Printable(strings.ToValidUTF8(msg, ""))
}

// workerOut is where the workers' output goes: the caller's Workers (the
// CLI's: beside the progress lines), or nowhere; the library writes to no
// stream of its own.
func (o RunOptions) workerOut() io.Writer {
	if o.Workers != nil {
		return o.Workers
	}
	return io.Discard
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// prefixWriter writes whole lines, each after prefix; a line longer than
// 4 KiB is cut there, so an endless line cannot grow memory.
type prefixWriter struct {
	prefix string
	w      io.Writer
	buf    []byte
}

const prefixLineMax = 4 << 10

func (p *prefixWriter) Write(b []byte) (int, error) {
	n := len(b)
	for len(b) > 0 {
		seg := b
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			seg = b[:i+1]
		}
		seg = seg[:min(len(seg), prefixLineMax-len(p.buf))]
		p.buf = append(p.buf, seg...)
		b = b[len(seg):]
		if p.buf[len(p.buf)-1] == '\n' || len(p.buf) >= prefixLineMax {
			p.flush()
		}
	}
	return n, nil
}

// flush writes what is buffered as one line.
func (p *prefixWriter) flush() {
	if len(p.buf) == 0 {
		return
	}
	if p.buf[len(p.buf)-1] != '\n' {
		p.buf = append(p.buf, '\n')
	}
	_, _ = p.w.Write(append([]byte(p.prefix), p.buf...))
	p.buf = p.buf[:0]
}
