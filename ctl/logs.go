package ctl

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/runnerclient"
)

// LogsOptions say how much of a task's output Logs prints.
type LogsOptions struct {
	// Follow streams from the task's runner until the job's output ends;
	// else what the shim kept so far is printed and Logs returns.
	Follow bool
	// Since starts the output at this time. It is read from the task's
	// runner (the shim's kept output has no times), so the task must be
	// running; without Follow the runner must be Tandem's (dstack's only
	// follows).
	Since time.Time
	// Tail, when TailSet, prints only the last Tail lines kept so far (0:
	// none, as docker logs --tail 0; then, with Follow, what comes after).
	Tail    int
	TailSet bool
}

// Logs prints a task's raw output to w: what its shim kept so far, or with
// Follow the stream from its runner until the job's output ends.
func (c *Client) Logs(ctx context.Context, ref string, lo LogsOptions, w io.Writer) error {
	since := lo.Since
	if !lo.Follow && !since.IsZero() {
		return c.logsSince(ctx, ref, lo, w)
	}
	if !lo.Follow || lo.TailSet {
		info, err := c.Resolve(ctx, ref)
		if err != nil {
			return err
		}
		now := c.clk.Now()
		out, flushTail := tailed(w, lo)
		err = c.keptLog(ctx, info, out)
		if werr := flushTail(); werr != nil {
			return werr
		}
		switch {
		case errors.Is(err, api.ErrNotFound):
			if !lo.Follow {
				return fmt.Errorf("task %s has no output kept yet", DisplayName(info))
			}
		case err != nil:
			return fmt.Errorf("%s: %w", DisplayName(info), err)
		}
		if !lo.Follow {
			return nil
		}
		// What comes after the kept lines (a line written meanwhile may
		// show twice; none is lost).
		since = now
		if info.Status != api.TaskRunning || JobEnded(info) {
			return nil
		}
	}
	return c.followLogs(ctx, ref, since, w)
}

// keptLog copies what the shim kept of a task's output into w. The shim
// reads a running job's output from its runner every quarter second or
// so: right after a run -d it may hold none of what the job printed yet.
// While the job runs and nothing is kept, the shim is asked again for up
// to keptLogWait, so that logs right after run -d shows the job's first
// lines; a job that printed nothing costs that wait.
func (c *Client) keptLog(ctx context.Context, info api.TaskInfoResponse, w io.Writer) error {
	cw := &countingWriter{w: w}
	err := c.shim.JobLog(ctx, info.ID, cw)
	if info.Status == api.TaskTerminated || JobEnded(info) || cw.n.Load() > 0 || err != nil && !errors.Is(err, api.ErrNotFound) {
		return err
	}
	_ = poll(ctx, c.clk, 100*time.Millisecond, keptLogWait, func() (bool, error) {
		err = c.shim.JobLog(ctx, info.ID, cw)
		return cw.n.Load() > 0 || err != nil && !errors.Is(err, api.ErrNotFound), nil
	})
	return err
}

// keptLogWait is how long logs waits for a running job's first kept
// output.
const keptLogWait = 1500 * time.Millisecond

// tailed is where output for w goes: w itself, or with lo.TailSet a
// tailWriter, whose last lo.Tail lines flush then writes to w.
func tailed(w io.Writer, lo LogsOptions) (out io.Writer, flush func() error) {
	if !lo.TailSet {
		return w, func() error { return nil }
	}
	t := &tailWriter{n: lo.Tail}
	return t, func() error {
		_, err := w.Write(t.bytes())
		return err
	}
}

// tailWriter keeps the last n lines written to it, and at most
// maxTailBytes of them (the oldest go first): the kept log is the job's
// output, bounded by the runner but not by the job itself.
type tailWriter struct {
	n     int
	lines [][]byte // whole lines, oldest first
	size  int      // bytes in lines and part
	part  []byte   // the line not yet ended
}

const maxTailBytes = 64 << 20

func (t *tailWriter) Write(p []byte) (int, error) {
	written := len(p)
	for len(p) > 0 {
		i := bytes.IndexByte(p, '\n')
		if i < 0 {
			t.part = append(t.part, p...)
			t.size += len(p)
			break
		}
		t.part = append(t.part, p[:i+1]...)
		t.size += i + 1
		t.lines, t.part = append(t.lines, t.part), nil
		p = p[i+1:]
	}
	for len(t.lines) > 0 && (len(t.lines) > t.n || t.size > maxTailBytes) {
		t.size -= len(t.lines[0])
		t.lines = t.lines[1:]
	}
	if over := len(t.part) - maxTailBytes; over > 0 { // one endless line: its end
		t.part = append([]byte(nil), t.part[over:]...)
		t.size -= over
	}
	return written, nil
}

func (t *tailWriter) bytes() []byte {
	lines := t.lines
	if len(t.part) > 0 {
		lines = append(lines, t.part)
		if len(lines) > t.n {
			lines = lines[1:]
		}
	}
	return bytes.Join(lines, nil)
}

// logsSince prints a running task's output from lo.Since to what its job
// has written so far (its last lo.Tail lines when lo.TailSet), read from its
// Tandem runner.
func (c *Client) logsSince(ctx context.Context, ref string, lo LogsOptions, w io.Writer) error {
	info, r, addr, err := c.runnerOf(ctx, ref, "logs --since")
	ended := func() error {
		return fmt.Errorf("the job of task %s has ended and its runner has left; the output kept on the host has no times: drop --since", DisplayName(info))
	}
	if info.ID != "" && info.Status != api.TaskRunning {
		return ended()
	}
	if err != nil {
		return err
	}
	hc, err := r.Healthcheck(ctx)
	if err != nil {
		if JobEnded(info) {
			return ended()
		}
		return withHint(HintRunnerPort, fmt.Errorf("runner of task %s at %s: %w", DisplayName(info), addr, err))
	}
	if hc.TandemVersion == "" {
		return fmt.Errorf("the runner of task %s is dstack's, which only follows output from a time: use --since with -f, or drop --since", DisplayName(info))
	}
	ls, err := r.LogsSoFar(ctx, lo.Since)
	if err != nil {
		return withHint(HintRunnerPort, fmt.Errorf("runner of task %s at %s: %w", DisplayName(info), addr, err))
	}
	defer ls.Close()
	out, flushTail := tailed(w, lo)
	if err := copyStream(out, ls); err != nil {
		return err
	}
	return flushTail()
}

// copyStream writes a log stream to w until it ends.
func copyStream(w io.Writer, ls *runnerclient.LogStream) error {
	for {
		b, err := ls.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if _, err := w.Write(b); err != nil {
			return err
		}
	}
}

// followLogs streams a running task's raw output (from since on) to w
// until the job's output ends.
func (c *Client) followLogs(ctx context.Context, ref string, since time.Time, w io.Writer) error {
	info, r, addr, err := c.runnerOf(ctx, ref, "logs")
	if info.ID != "" && (info.Status == api.TaskTerminated || JobEnded(info) && (err != nil || !runnerAnswers(ctx, r))) {
		_, err := c.attachEnded(ctx, info, w, Result{})
		return err
	}
	if err != nil {
		return err
	}
	ls, err := r.Logs(ctx, since)
	if err != nil {
		return withHint(HintRunnerPort, fmt.Errorf("runner of task %s at %s: %w", DisplayName(info), addr, err))
	}
	defer ls.Close()
	return copyStream(w, ls)
}
