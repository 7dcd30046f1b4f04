package logs

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"sync"
	"time"

	"github.com/tandem-run/tandem/api"
)

// Journal is what /api/pull reads: the job's states, the job's stripped
// log lines and the runner's own log lines, each stamped by one clock so
// that a pull from last_updated never misses or repeats an event. Events
// live on disk (Store); memory holds their index.
type Journal struct {
	clock               *Clock
	jobLogs, runnerLogs *Store
	log                 *slog.Logger

	pace *pacer

	mu     sync.Mutex // guards states; appended under the clock's stamp
	states []api.JobStateEvent

	beforeFinal func(api.JobStateEvent)
}

// JournalConfig is how a journal keeps its events.
type JournalConfig struct {
	Now func() time.Time // the clock's source (time.Now when nil)
	// Log receives refused state transitions and the job output's holds
	// (nil: discarded).
	Log *slog.Logger
	// Retention bounds the job log's store on disk (the runner's own log
	// is small).
	Retention Retention
	// ReaderGrace: while the reader of /api/pull pulled within it, the
	// job's output waits for it rather than have the bound drop what it
	// has not had; ≤ 0 never waits.
	ReaderGrace time.Duration
	// BeforeFinal, when set, gets the job's final state once it is
	// allowed and before any reader can see it: what must hold by the
	// time a reader learns the job ended (the state file the shim reads)
	// is done here.
	BeforeFinal func(api.JobStateEvent)
}

// OpenJournal creates the journal's stores in dir.
func OpenJournal(dir string, c JournalConfig) (*Journal, error) {
	jl, err := OpenStoreRetained(filepath.Join(dir, "job_logs.events"), c.Retention)
	if err != nil {
		return nil, err
	}
	rl, err := OpenStore(filepath.Join(dir, "runner_logs.events"))
	if err != nil {
		jl.Close()
		return nil, err
	}
	log := c.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	j := &Journal{clock: NewClock(c.Now), jobLogs: jl, runnerLogs: rl, log: log, pace: newPacer(c.ReaderGrace), beforeFinal: c.BeforeFinal}
	j.pace.onHold = func(behind int64) {
		log.Info("job output is held until the log's reader catches up (as a terminal holds a writer): pulling on would drop what it has not had",
			"over_bytes", behind, "reader_grace", c.ReaderGrace)
	}
	j.pace.onGone = func(behind int64) {
		log.Warn("the log's reader has not pulled within its grace: job output flows again and the log's bound drops its middle",
			"over_bytes", behind, "reader_grace", c.ReaderGrace)
	}
	j.pace.onSpent = func(behind int64, held time.Duration) {
		log.Warn("job output was held for its reader this long in all: it flows from now on and the log's bound drops its middle",
			"over_bytes", behind, "held", held)
	}
	return j, nil
}

// Acked records that the reader of /api/pull has had every event up to
// after (it asked for what follows): output held for it may flow. A pull
// that neither moves on nor has caught up does not count as the reader's.
func (j *Journal) Acked(after int64) { j.pace.ack(after, after >= j.jobLogs.Newest()) }

// ReleaseOutput stops holding the job's output for a reader, for good
// (the job's terminal is being closed).
func (j *Journal) ReleaseOutput() { j.pace.release() }

// Close releases the stores' files.
func (j *Journal) Close() error { return errors.Join(j.jobLogs.Close(), j.runnerLogs.Close()) }

// ErrTransition means a job state may not follow the last one.
var ErrTransition = errors.New("job state transition refused")

// AppendState records a job state if the job may enter it from the last
// one (api.JobState.CanFollow); a refused one is logged and not recorded.
func (j *Journal) AppendState(ev api.JobStateEvent) error {
	var err error
	j.clock.Stamp(func(ts int64) {
		ev.Timestamp = ts
		j.mu.Lock()
		defer j.mu.Unlock()
		var prev api.JobState
		if n := len(j.states); n > 0 {
			prev = j.states[n-1].State
		}
		if !ev.State.CanFollow(prev) {
			err = fmt.Errorf("%w: %s to %s", ErrTransition, prev, ev.State)
			j.log.Error("job state transition refused", "from", prev, "to", ev.State)
			return
		}
		if ev.State.Final() && j.beforeFinal != nil {
			j.beforeFinal(ev)
		}
		j.states = append(j.states, ev)
	})
	return err
}

// AppendJobLog stores one stripped chunk of the job's output, first waiting
// while storing it would drop output an active reader has not had.
func (j *Journal) AppendJobLog(b []byte) {
	keep := j.pace.wait(func(acked int64) int64 { return j.jobLogs.Behind(acked, len(b)) })
	j.append(j.jobLogs, b, keep)
}

// AppendRunnerLog stores one line of the runner's own log.
func (j *Journal) AppendRunnerLog(b []byte) { j.append(j.runnerLogs, b, keepAll) }

func (j *Journal) append(s *Store, b []byte, keepAfter int64) {
	j.clock.Stamp(func(ts int64) {
		if err := s.AppendKeeping(ts, b, keepAfter); err != nil {
			j.log.Error("store log event", "err", err)
		}
	})
}

// RunnerLogWriter is an io.Writer whose every Write is one runner log event
// (a slog handler's sink).
func (j *Journal) RunnerLogWriter() io.Writer { return runnerLogWriter{j} }

type runnerLogWriter struct{ j *Journal }

func (w runnerLogWriter) Write(p []byte) (int, error) {
	w.j.AppendRunnerLog(append([]byte(nil), p...))
	return len(p), nil
}

// Window is one pull's worth of the journal.
type Window struct {
	States              []api.JobStateEvent
	JobLogs, RunnerLogs []Event
	// LastUpdated is where the next pull starts: the clock's last stamp, or
	// the last included event when Capped.
	LastUpdated int64
	Capped      bool
}

// StatesSince returns the job states after ts and the clock's last stamp,
// where the next pull starts: the answer to a caller that reads the
// output elsewhere (/logs_ws) and wants only how the job stands.
func (j *Journal) StatesSince(after int64) (states []api.JobStateEvent, last int64) {
	j.clock.Lock(func(l int64) {
		last = l
		states = j.statesIn(after, last)
	})
	return states, last
}

// statesIn returns the job states stamped in (after, upTo].
func (j *Journal) statesIn(after, upTo int64) []api.JobStateEvent {
	j.mu.Lock()
	defer j.mu.Unlock()
	var out []api.JobStateEvent
	for _, s := range j.states {
		if s.Timestamp > after && s.Timestamp <= upTo {
			out = append(out, s)
		}
	}
	return out
}

// Since returns the events after ts, with at most byteCap bytes of logs
// (the two log streams merged by time; at least one event, so a huge one
// cannot stall the stream). Only the window's bounds are decided under the
// clock's lock; the disk reads happen after it, so a large pull never
// holds up the job's output.
func (j *Journal) Since(after int64, byteCap int) (Window, error) {
	var w Window
	j.clock.Lock(func(last int64) {
		w.LastUpdated, w.Capped = PullWindow(after, last, byteCap, j.jobLogs, j.runnerLogs)
		w.States = j.statesIn(after, w.LastUpdated)
	})
	var err error
	if w.JobLogs, _, err = j.jobLogs.After(after, w.LastUpdated, 1<<62); err != nil {
		return w, err
	}
	if w.RunnerLogs, _, err = j.runnerLogs.After(after, w.LastUpdated, 1<<62); err != nil {
		return w, err
	}
	return w, nil
}
