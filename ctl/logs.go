package ctl

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync/atomic"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/runnerclient"
	"github.com/tandem-run/tandem/api/shimclient"
)

// TaskOptions reach a task's runner: through the shim that runs it (whose
// task details say where the runner answers; ports given here override).
type TaskOptions struct {
	Shim      string
	ShimToken string // bearer token for a shim started with --api-token
	Ports     Ports  // overrides; 0: as the shim reports
	Dial      func(ctx context.Context, network, addr string) (net.Conn, error)
	// Clock is what waits run on (nil: the real one).
	Clock Clock
}

// runnerOf resolves ref and returns the task and a client of its runner.
func runnerOf(ctx context.Context, ref string, o TaskOptions, what string) (api.TaskInfoResponse, *runnerclient.Client, string, error) {
	shim, err := newShimClient(o.Shim, o.Dial, o.ShimToken)
	if err != nil {
		return api.TaskInfoResponse{}, nil, "", err
	}
	info, err := Resolve(ctx, shim, ref)
	if err != nil {
		return info, nil, "", err
	}
	if info.Status != api.TaskRunning {
		msg := fmt.Sprintf("task %s is %s", DisplayName(info), info.Status)
		if info.Status == api.TaskTerminated {
			msg += fmt.Sprintf(" (%s)", info.TerminationReason)
		}
		return info, nil, "", fmt.Errorf("%s; %s needs a running task", msg, what)
	}
	r, addr, err := runnerFor(o.Shim, info, o.Ports.HTTP, o.Dial)
	return info, r, addr, err
}

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
func Logs(ctx context.Context, ref string, o TaskOptions, lo LogsOptions, w io.Writer) error {
	since := lo.Since
	if !lo.Follow && !since.IsZero() {
		return logsSince(ctx, ref, o, lo, w)
	}
	if !lo.Follow || lo.TailSet {
		shim, err := newShimClient(o.Shim, o.Dial, o.ShimToken)
		if err != nil {
			return err
		}
		info, err := Resolve(ctx, shim, ref)
		if err != nil {
			return err
		}
		now := clockOr(o.Clock).Now()
		out, flushTail := tailed(w, lo)
		err = keptLog(ctx, o.Clock, shim, info, out)
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
	return followLogs(ctx, ref, o, since, w)
}

// keptLog copies what the shim kept of a task's output into w. The shim
// reads a running job's output from its runner every quarter second or
// so: right after a run -d it may hold none of what the job printed yet.
// While the job runs and nothing is kept, the shim is asked again for up
// to keptLogWait, so that logs right after run -d shows the job's first
// lines; a job that printed nothing costs that wait.
func keptLog(ctx context.Context, clk Clock, shim *shimclient.Client, info api.TaskInfoResponse, w io.Writer) error {
	cw := &countingWriter{w: w}
	err := shim.JobLog(ctx, info.ID, cw)
	if info.Status == api.TaskTerminated || JobEnded(info) || cw.n.Load() > 0 || err != nil && !errors.Is(err, api.ErrNotFound) {
		return err
	}
	_ = poll(ctx, clk, 100*time.Millisecond, keptLogWait, func() (bool, error) {
		err = shim.JobLog(ctx, info.ID, cw)
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
func logsSince(ctx context.Context, ref string, o TaskOptions, lo LogsOptions, w io.Writer) error {
	info, r, addr, err := runnerOf(ctx, ref, o, "logs --since")
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
func followLogs(ctx context.Context, ref string, o TaskOptions, since time.Time, w io.Writer) error {
	info, r, addr, err := runnerOf(ctx, ref, o, "logs")
	if info.ID != "" && (info.Status == api.TaskTerminated || JobEnded(info) && (err != nil || !runnerAnswers(ctx, r))) {
		_, err := attachEnded(ctx, info, o, w, Result{})
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

// Attach follows a running task's job: its output from since on (the
// start when zero) to out, until the job ends; the result carries the
// job's exit. Cancelling ctx while it follows detaches (Result.Detached),
// leaving the job running.
func Attach(ctx context.Context, ref string, o TaskOptions, since time.Time, out, status io.Writer) (Result, error) {
	info, r, addr, err := runnerOf(ctx, ref, o, "attach")
	res := Result{TaskID: info.ID, Name: TaskName(info)}
	var hcErr error
	if err == nil {
		var hc api.HealthcheckResponse
		if hc, hcErr = r.Healthcheck(ctx); hcErr == nil && hc.TaskID != "" && hc.TaskID != info.ID {
			// A runner from before tasks were named in calls.
			hcErr = fmt.Errorf("the runner there serves task %s", api.Printable(hc.TaskID))
		}
	}
	if info.ID != "" && (info.Status == api.TaskTerminated || JobEnded(info) && (err != nil || hcErr != nil)) {
		// The task or its job ended and its runner is gone: the shim kept
		// its output and its status.
		return attachEnded(ctx, info, o, out, res)
	}
	if err != nil {
		return res, err
	}
	if hcErr != nil {
		return res, withHint(HintRunnerPort, fmt.Errorf("runner of task %s at %s: %w", DisplayName(info), addr, hcErr))
	}
	var st streamState
	shown := &countingWriter{w: out}
	err = watchJobStream(ctx, o.Clock, r.PeekStates, sinceOpener(r, since), shown, nil, nil, &res, nil, &st) // no stops: onStop is never called
	switch {
	case ctx.Err() != nil:
	case !st.connected.Load():
		// The runner left as we attached (a detached run's runner leaves
		// at the job's end) before showing anything: the shim keeps the
		// output and the end.
		if ended, ok := waitJobEnd(ctx, o, info.ID); ok {
			return attachEnded(ctx, ended, o, out, res)
		}
		if status != nil {
			fmt.Fprintf(status, "log stream: the runner of %s did not stream its output\n", DisplayName(info))
		}
	case !st.complete.Load():
		// The stream was cut (the runner left as the job ended, with its
		// output partly sent, or before telling the end): the shim keeps
		// the whole output and the end. What was shown is not shown twice.
		if ended, ok := waitJobEnd(ctx, o, info.ID); ok {
			if since.IsZero() {
				return attachRest(ctx, ended, o, out, shown.n.Load(), res)
			}
			res.endedWith(*ended.Tandem.Job)
			if status != nil {
				fmt.Fprintf(status, "log stream: the runner of %s left before sending all of its output (tandem logs %s has it)\n", DisplayName(info), DisplayName(info))
			}
			return res, nil
		}
	case err != nil:
		// The output was shown, then the runner left before telling the
		// job's end: the shim knows it.
		if ended, ok := waitJobEnd(ctx, o, info.ID); ok {
			res.endedWith(*ended.Tandem.Job)
			return res, nil
		}
	}
	if ctx.Err() != nil {
		res.Detached, res.Interrupted = true, true
		return res, nil
	}
	if err != nil {
		return res, fmt.Errorf("%s: %w", DisplayName(info), err)
	}
	return res, nil
}

// waitJobEnd waits (10 s at most) for the shim to know a task's job ended.
func waitJobEnd(ctx context.Context, o TaskOptions, id string) (api.TaskInfoResponse, bool) {
	shim, err := newShimClient(o.Shim, o.Dial, o.ShimToken)
	if err != nil {
		return api.TaskInfoResponse{}, false
	}
	var info api.TaskInfoResponse
	err = poll(ctx, o.Clock, 200*time.Millisecond, 10*time.Second, func() (bool, error) {
		var err error
		info, err = shim.GetTask(ctx, id)
		return err == nil && JobEnded(info), nil
	})
	return info, err == nil
}

func runnerAnswers(ctx context.Context, r *runnerclient.Client) bool {
	if r == nil {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	_, err := r.Healthcheck(ctx)
	return err == nil
}

// attachEnded prints a finished job's (or terminated task's) kept output
// from the shim and returns its end.
func attachEnded(ctx context.Context, info api.TaskInfoResponse, o TaskOptions, out io.Writer, res Result) (Result, error) {
	return attachRest(ctx, info, o, out, 0, res)
}

// attachRest prints a finished job's kept output from the shim, less its
// first skip bytes (shown already), and returns its final state.
func attachRest(ctx context.Context, info api.TaskInfoResponse, o TaskOptions, out io.Writer, skip int64, res Result) (Result, error) {
	shim, err := newShimClient(o.Shim, o.Dial, o.ShimToken)
	if err != nil {
		return res, err
	}
	if err := shim.JobLog(ctx, info.ID, &skipWriter{w: out, skip: skip}); err != nil && !errors.Is(err, api.ErrNotFound) {
		return res, fmt.Errorf("%s: %w", DisplayName(info), err)
	}
	if JobEnded(info) {
		res.endedWith(*info.Tandem.Job)
	} else {
		res.endedWithTask(info)
	}
	return res, nil
}

// countingWriter is w that counts the bytes written to it.
type countingWriter struct {
	w io.Writer
	n atomic.Int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n.Add(int64(n))
	return n, err
}

// skipWriter is w less the first skip bytes written to it.
type skipWriter struct {
	w    io.Writer
	skip int64
}

func (s *skipWriter) Write(p []byte) (int, error) {
	if s.skip >= int64(len(p)) {
		s.skip -= int64(len(p))
		return len(p), nil
	}
	rest := p[s.skip:]
	s.skip = 0
	if _, err := s.w.Write(rest); err != nil {
		return 0, err
	}
	return len(p), nil
}

// Remove removes a finished task (terminated, or its job ended), or with
// force a running one, stopped at once first (docker rm -f). A running
// task without force is refused: a stop keeps it (StopTask), a remove
// loses its output and exit status, so it is never done by default.
func Remove(ctx context.Context, shim *shimclient.Client, info api.TaskInfoResponse, force bool, timeout uint) error {
	if info.Status != api.TaskTerminated && !JobEnded(info) {
		if !force {
			return withHint(HintRemoveRunning, fmt.Errorf("task %s is %s", DisplayName(info), info.Status))
		}
	}
	if err := cleanup(ctx, nil, shim, info.ID, timeout, false); err != nil {
		return fmt.Errorf("%s %s", DisplayName(info), err)
	}
	return nil
}

// StopTask stops a task's job (timeout seconds of grace, then a kill) and
// keeps the task, as docker stop keeps a container: its output, its exit
// status and its ps -a row stay until Remove. A task already stopped is
// fine.
func StopTask(ctx context.Context, shim *shimclient.Client, info api.TaskInfoResponse, timeout uint) error {
	if info.Status == api.TaskTerminated {
		return nil
	}
	if err := terminate(ctx, nil, shim, info.ID, timeout); err != nil {
		return fmt.Errorf("%s %s", DisplayName(info), err)
	}
	return nil
}

// JobStatus asks a running task's runner how its job stands (the last job
// state), within a short bound; ok is false when the runner does not say.
func JobStatus(ctx context.Context, info api.TaskInfoResponse, o TaskOptions) (api.JobStateEvent, bool) {
	if info.Status != api.TaskRunning {
		return api.JobStateEvent{}, false
	}
	r, _, err := runnerFor(o.Shim, info, o.Ports.HTTP, o.Dial)
	if err != nil {
		return api.JobStateEvent{}, false
	}
	return lastJobState(ctx, r)
}

// lastJobState peeks at the runner's last job state (it stays for the
// next pull), within a short bound.
func lastJobState(ctx context.Context, r *runnerclient.Client) (api.JobStateEvent, bool) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	p, err := r.Peek(ctx, 0)
	if err != nil || len(p.JobStates) == 0 {
		return api.JobStateEvent{}, false
	}
	return p.JobStates[len(p.JobStates)-1], true
}

// newShimClient is the shim client every command uses.
func newShimClient(addr string, dial func(ctx context.Context, network, addr string) (net.Conn, error), token string) (*shimclient.Client, error) {
	c, err := shimclient.NewWithDialer(addr, unreachableAs(addr, dial))
	if err != nil {
		return nil, err
	}
	c.SetToken(token)
	c.SetFresh(true) // rm and attach act on the job's end as soon as it is written
	return c, nil
}

// NewShimClient returns a client of the shim at addr.
func NewShimClient(addr, token string, dial func(ctx context.Context, network, addr string) (net.Conn, error)) (*shimclient.Client, error) {
	return newShimClient(addr, dial, token)
}
