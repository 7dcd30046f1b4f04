package ctl

// Following a run: the job's output and states until it ends.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync/atomic"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/runnerclient"
)

// follow streams raw output to out and waits for the job's end; the
// first stop request stops the job, ctx's end returns at once (killed: the
// caller kills the task). What it has to say goes to c's Progress.
func follow(ctx context.Context, c *Client, r *runnerclient.Client, open logOpener, stops <-chan struct{}, out io.Writer, res Result) (_ Result, killed bool, err error) {
	stopped := false
	if open == nil {
		open = sinceOpener(r, time.Time{})
	}
	w := jobWatch{clk: c.clk, pull: r.PullStates, open: open, out: out, say: c.say, stops: stops, onStop: func() bool {
		if !stopped {
			stopped = true
			c.say.emit(Event{Kind: EventStopping, Text: "stopping the job"})
			_ = r.Stop(ctx)
		}
		return false
	}}
	err = w.run(ctx, &res)
	if ctx.Err() != nil {
		c.say.status("killing the job")
		res.State, res.Interrupted = api.JobTerminated, true
		return res, true, nil
	}
	if err == nil && stopped && res.State == api.JobTerminated {
		res.Interrupted = true
	}
	return res, false, err
}

// jobWatch is one watch of a job: its raw output streamed to out, its
// states asked for until the final one.
type jobWatch struct {
	clk Clock
	// pull asks for the states: the run's own pull or an onlooker's peek.
	pull statePuller
	open logOpener // the output stream
	out  io.Writer // the job's output
	say  say       // what the watch has to say (a stream that did not open)
	// stops are stop requests (nil: none); each calls onStop, and true
	// ends the watch there.
	stops  <-chan struct{}
	onStop func() bool
	// stream, when set, records how the output stream went.
	stream *streamState
}

// pullWatch is the driver's watch of r's job, its output from since on.
func pullWatch(clk Clock, r *runnerclient.Client, since time.Time, out io.Writer) jobWatch {
	return jobWatch{clk: clk, pull: r.PullStates, open: sinceOpener(r, since), out: out}
}

// statePuller asks the runner for the job's states after a timestamp: the
// run's own pull (it drives the job: its reading the end lets the runner
// finish), or an onlooker's peek (tandem attach, which must not end a job
// the dstack server drives before the server collected its logs).
type statePuller func(ctx context.Context, timestamp int64) (api.PullResponse, error)

// logOpener opens the job's output stream.
type logOpener func(ctx context.Context) (*runnerclient.LogStream, error)

// sinceOpener opens r's output stream from since on.
func sinceOpener(r *runnerclient.Client, since time.Time) logOpener {
	return func(ctx context.Context) (*runnerclient.LogStream, error) { return r.LogsWithEnd(ctx, since) }
}

// openedStream is a stream opened ahead: open hands over what the dial
// sent on ch; a caller that leaves first has the stream closed when it
// comes.
func openedStream(ch <-chan openedLogs) logOpener {
	return func(ctx context.Context) (*runnerclient.LogStream, error) {
		select {
		case d := <-ch:
			return d.ls, d.err
		case <-ctx.Done():
			go func() { (<-ch).close() }()
			return nil, ctx.Err()
		}
	}
}

// openedLogs is the outcome of a stream's dial.
type openedLogs struct {
	ls  *runnerclient.LogStream
	err error
}

func (d openedLogs) close() {
	if d.ls != nil {
		d.ls.Close()
	}
}

// run streams the job's output and pulls its states until the final one,
// which it records in res once every byte of output was shown (or
// outputStall passed with none).
func (w jobWatch) run(ctx context.Context, res *Result) error {
	clk := clockOr(w.clk)
	st := w.stream
	if st == nil {
		st = new(streamState)
	}
	wsDone, moved, stopStream := w.startStream(ctx, st)
	defer stopStream()
	// States only: the output comes from the stream above, and a pull of
	// the logs would make the runner hold the job for them. A pull runs
	// beside the watch: a stream that ends with the job's end state ends
	// the watch at once, not after a pull under way (a round trip over a
	// long link). The first is asked after a poll's wait: the stream shows
	// the job's start and, from a Tandem runner, its end.
	pullCtx, cancelPull := context.WithCancel(ctx)
	defer cancelPull()
	pulls := statePulls{pull: w.pull}
	streamEnd := wsDone
	quick := 0 // looks left at the quick pace
	next := clk.After(statePoll)
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-w.stops:
			if w.onStop() {
				return nil
			}
		case <-streamEnd:
			// The output ended: the job ended. A Tandem runner said how
			// at the stream's end (no pull). Otherwise its final state
			// follows within moments: looked for at once, then at the
			// quick pace for a while, so a short job is not held to the
			// slow pace's half second.
			if end := st.end.Load(); end != nil {
				res.endedWith(*end)
				return nil
			}
			streamEnd, quick = nil, endLooks
			pulls.start(pullCtx)
		case <-next:
			next = nil
			pulls.start(pullCtx)
		case got := <-pulls.inflight:
			pulls.inflight = nil
			if got.err != nil {
				return fmt.Errorf("pull job state: %w", got.err)
			}
			pulls.after = got.p.LastUpdated
			if n := len(got.p.JobStates); n > 0 && got.p.JobStates[n-1].State.Final() {
				res.endedWith(got.p.JobStates[n-1])
				drainOutput(clk, wsDone, moved)
				return nil
			}
			every := statePoll
			if quick > 0 {
				every, quick = endPoll, quick-1
			}
			next = clk.After(every)
		}
	}
}

// startStream streams the job's output to out beside the watch: done is
// closed once the stream ended, moved says output arrived; stop ends the
// stream and returns once nothing more is written to out, nor recorded in
// st.
func (w jobWatch) startStream(ctx context.Context, st *streamState) (done <-chan struct{}, moved <-chan struct{}, stop func()) {
	wsDone := make(chan struct{})
	wsCtx, cancel := context.WithCancel(ctx)
	mv := make(chan struct{}, 1) // output arrived since the last look
	go func() {
		defer close(wsDone)
		streamLogs(wsCtx, w.open, movedWriter{w.out, mv}, w.say, st)
	}()
	return wsDone, mv, func() {
		cancel()
		<-wsDone
	}
}

// statePulls asks for the job's states, one pull at a time: inflight
// delivers the pull under way (nil: none).
type statePulls struct {
	pull     statePuller
	after    int64 // the timestamp the next pull asks from
	inflight chan pulled
}

// pulled is one pull's answer.
type pulled struct {
	p   api.PullResponse
	err error
}

// start asks for the states after s.after, unless a pull is under way.
func (s *statePulls) start(ctx context.Context) {
	if s.inflight != nil {
		return
	}
	ch := make(chan pulled, 1)
	s.inflight = ch
	after := s.after
	go func() {
		p, err := s.pull(ctx, after)
		ch <- pulled{p, err}
	}()
}

// How often a run asks its runner for the job's states: statePoll while
// the job runs, endPoll for endLooks looks once its output ended.
const (
	statePoll = 500 * time.Millisecond
	endPoll   = 10 * time.Millisecond
	endLooks  = 200
)

// outputStall is how long the end of a run waits for output that does not
// come: a job runs at its own pace, not its watcher's, so its output may
// still be on its way when it ends (a slow link, a terminal behind), and
// that wait lasts as long as output keeps arriving.
const outputStall = 10 * time.Second

// drainOutput returns once the output stream ended (every byte shown) or
// no output arrived for outputStall.
func drainOutput(clk Clock, done <-chan struct{}, moved <-chan struct{}) {
	select { // what arrived before the end does not count
	case <-moved:
	default:
	}
	for {
		select {
		case <-done:
			return
		case <-clk.After(outputStall):
			select {
			case <-moved: // output arrived meanwhile: wait on
			default:
				return
			}
		}
	}
}

// movedWriter is out that says, on moved, that output arrived.
type movedWriter struct {
	out   io.Writer
	moved chan<- struct{}
}

func (w movedWriter) Write(p []byte) (int, error) {
	select {
	case w.moved <- struct{}{}:
	default:
	}
	return w.out.Write(p)
}

// streamState is how an output stream went: whether it connected, and
// whether it ended with the runner's close (every byte delivered) rather
// than cut (the runner left mid-stream, the link broke).
type streamState struct {
	connected, complete atomic.Bool
	// end is the job's final state the runner sent at the stream's end
	// (a stream opened with LogsWithEnd, from a Tandem runner).
	end atomic.Pointer[api.JobStateEvent]
}

// streamLogs copies the job's raw output (the stream open opens) to out
// until it ends or ctx does; st (when not nil) records how it went, and a
// stream that did not open is said to s.
func streamLogs(ctx context.Context, open logOpener, out io.Writer, s say, st *streamState) {
	ls, err := open(ctx)
	if err != nil {
		if ctx.Err() == nil {
			s.status("log stream: %v", err)
		}
		return
	}
	if st != nil {
		st.connected.Store(true)
	}
	defer ls.Close()
	// A stream opened ahead lives on its dialer's context: it ends with
	// this one.
	defer context.AfterFunc(ctx, func() { ls.Close() })()
	for {
		b, err := ls.Next()
		if err != nil {
			if st != nil && errors.Is(err, io.EOF) {
				if end, ok := ls.End(); ok {
					st.end.Store(&end)
				}
				st.complete.Store(true)
			}
			return
		}
		_, _ = out.Write(b)
	}
}
