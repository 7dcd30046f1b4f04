package logs

import (
	"bytes"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// syncBuffer is a log sink that a test may read while the journal writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// pacedJournal is a journal whose job log keeps 1 MiB of head and 4 MiB
// in all, waiting grace for a reader.
func pacedJournal(t *testing.T, grace time.Duration, log *syncBuffer) (*Journal, string) {
	t.Helper()
	dir := t.TempDir()
	c := JournalConfig{Retention: Retention{Head: 1 << 20, Max: 4 << 20}, ReaderGrace: grace}
	if log != nil {
		c.Log = slog.New(slog.NewTextHandler(log, nil))
	}
	j, err := OpenJournal(dir, c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { j.Close() })
	return j, filepath.Join(dir, "job_logs.events")
}

// writeLines appends lines 0..n-1 of the job's output, then closes done.
func writeLines(j *Journal, n int) <-chan struct{} { return writeRange(j, 0, n) }

// writeRange appends lines from..to-1 of the job's output, then closes done.
func writeRange(j *Journal, from, to int) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := from; i < to; i++ {
			j.AppendJobLog([]byte(line(i)))
		}
	}()
	return done
}

// pullAll pulls like dstack's server, each pull acknowledging the last,
// until stop is closed and a pull comes back empty; it returns the job
// log's lines.
func pullAll(t *testing.T, j *Journal, every time.Duration, stop <-chan struct{}) [][]byte {
	t.Helper()
	return pullAllFrom(t, j, 0, every, stop)
}

// pullAllFrom is pullAll from timestamp ts.
func pullAllFrom(t *testing.T, j *Journal, ts int64, every time.Duration, stop <-chan struct{}) [][]byte {
	t.Helper()
	var got [][]byte
	for {
		j.Acked(ts)
		w, err := j.Since(ts, 64<<10)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range w.JobLogs {
			got = append(got, e.Data)
		}
		ts = w.LastUpdated
		select {
		case <-stop:
			if len(w.JobLogs) == 0 {
				return got
			}
		default:
		}
		time.Sleep(every)
	}
}

// TestOutputWaitsForAPullingReader: 40 MiB of output through a log that
// keeps 4 MiB, read by a reader that keeps pulling (a page every 2 ms):
// every line arrives, in order, with no marker, because the writer is
// held while the reader is behind; the file stays within its bound.
func TestOutputWaitsForAPullingReader(t *testing.T) {
	var log syncBuffer
	j, path := pacedJournal(t, time.Minute, &log)
	const n = 40 << 20 / 100
	j.Acked(0) // the reader is there before the job prints
	done := writeLines(j, n)
	got := pullAll(t, j, 5*time.Millisecond, done)
	if !strings.Contains(log.String(), "job output is held") {
		t.Errorf("the hold was not logged: %s", log.String())
	}
	if len(got) != n {
		for i, l := range got {
			if bytes.HasPrefix(l, []byte("[tandem:")) {
				t.Fatalf("line %d is a marker: %q", i, l)
			}
		}
		t.Fatalf("%d lines delivered, want %d", len(got), n)
	}
	for i, l := range got {
		if string(l) != line(i) {
			t.Fatalf("line %d: %q", i, l)
		}
	}
	if disk := blocksOnDisk(t, path); disk > 4<<20+2*punchStep {
		t.Fatalf("%d bytes on disk, bound 4 MiB", disk)
	}
}

// TestOutputFlowsWhenTheReaderIsGone: a reader that pulled once and went
// silent holds the job for its grace only; then output flows, the middle
// is dropped and a marker stands in its place, and a reader back later
// gets the head, the marker and the newest lines.
func TestOutputFlowsWhenTheReaderIsGone(t *testing.T) {
	grace := 300 * time.Millisecond
	var log syncBuffer
	j, path := pacedJournal(t, grace, &log)
	const n = 40 << 20 / 100
	// 3 MiB first, under the 4 MiB bound, with no reader yet: the reader's
	// grace then starts a moment before the bound is reached, however slow
	// the machine (with the pull first, writing up to the bound on a loaded
	// CI machine outlasted the grace and nothing was ever held).
	const under = 3 << 20 / 100
	<-writeRange(j, 0, under)
	j.Acked(0)
	start := time.Now()
	select {
	case <-writeRange(j, under, n):
	case <-time.After(30 * time.Second):
		t.Fatal("the job is still held 30 s after its reader went silent")
	}
	if held := time.Since(start); held < grace {
		t.Fatalf("the job ran through in %v: it was not held for a reader within its grace (%v)", held, grace)
	}
	for _, want := range []string{"job output is held", "has not pulled within its grace"} {
		if !strings.Contains(log.String(), want) {
			t.Errorf("log lacks %q: %s", want, log.String())
		}
	}
	if disk := blocksOnDisk(t, path); disk > 4<<20+2*punchStep {
		t.Fatalf("%d bytes on disk, bound 4 MiB", disk)
	}
	w, err := j.Since(0, 64<<20)
	if err != nil {
		t.Fatal(err)
	}
	markers, last := 0, ""
	for _, e := range w.JobLogs {
		if bytes.HasPrefix(e.Data, []byte("[tandem: ")) {
			markers++
		}
		last = string(e.Data)
	}
	if markers != 1 || string(w.JobLogs[0].Data) != line(0) || last != line(n-1) {
		t.Fatalf("%d markers, first %q, last %q", markers, w.JobLogs[0].Data, last)
	}
}

// TestOutputNeverWaitsWithoutAReader: before any pull, and with pacing off,
// the writer is never held.
func TestOutputNeverWaitsWithoutAReader(t *testing.T) {
	for _, grace := range []time.Duration{time.Hour, 0} {
		t.Run(fmt.Sprint(grace), func(t *testing.T) {
			j, _ := pacedJournal(t, grace, nil)
			if grace == 0 {
				j.Acked(0)
			}
			select {
			case <-writeLines(j, 20<<20/100):
			case <-time.After(30 * time.Second):
				t.Fatal("the writer was held with no reader to wait for")
			}
		})
	}
}

// TestReleasedOutputKeepsWhatTheReaderHasNotHad: once released (the
// job's terminal is closing), output is no longer held, and the bound
// still drops nothing an active reader has not had: the file grows past
// it instead, and the reader gets every line.
func TestReleasedOutputKeepsWhatTheReaderHasNotHad(t *testing.T) {
	j, _ := pacedJournal(t, time.Minute, nil)
	j.Acked(0)
	j.ReleaseOutput()
	const n = 12 << 20 / 100
	<-writeLines(j, n)
	closed := make(chan struct{})
	close(closed)
	got := pullAll(t, j, 0, closed)
	if len(got) != n {
		t.Fatalf("%d lines delivered, want %d", len(got), n)
	}
}

// TestAStrayReaderDoesNotHoldTheJob: a caller that keeps pulling from the
// start (timestamp=0) without ever moving on is no reader to wait for:
// the job is held for the grace of the first pull only, then its output
// flows and the bound drops the middle, with its marker.
func TestAStrayReaderDoesNotHoldTheJob(t *testing.T) {
	grace := 300 * time.Millisecond
	var log syncBuffer
	j, _ := pacedJournal(t, grace, &log)
	const n = 20 << 20 / 100
	j.Acked(0)
	done := writeLines(j, n)
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(grace / 6):
				j.Acked(0)
			}
		}
	}()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("a reader pulling timestamp=0 held the job for 30 s")
	}
	if !strings.Contains(log.String(), "has not pulled within its grace") {
		t.Errorf("the reader's end was not logged: %s", log.String())
	}
	w, err := j.Since(0, 64<<20)
	if err != nil {
		t.Fatal(err)
	}
	markers := 0
	for _, e := range w.JobLogs {
		if bytes.HasPrefix(e.Data, []byte("[tandem: ")) {
			markers++
		}
	}
	if markers != 1 {
		t.Fatalf("%d markers, want the one of the dropped middle", markers)
	}
}

// TestACaughtUpReaderStillCounts: a reader that has every event pulls
// with the same timestamp while the job is quiet (it has nothing to move
// on to); quiet for longer than the grace, it is still there, and the
// job's next burst, between two of its pulls, waits for it: every line
// arrives, no marker.
func TestACaughtUpReaderStillCounts(t *testing.T) {
	grace := 300 * time.Millisecond
	var log syncBuffer
	j, _ := pacedJournal(t, grace, &log)
	<-writeLines(j, 10)
	w, err := j.Since(0, 64<<10)
	if err != nil {
		t.Fatal(err)
	}
	ts := w.LastUpdated
	j.Acked(ts)
	// Quiet for three graces, the reader pulling from where it is.
	for quiet := time.Now(); time.Since(quiet) < 3*grace; time.Sleep(grace / 6) {
		j.Acked(ts)
	}
	const n = 20 << 20 / 100
	done := writeRange(j, 10, n)
	// The reader pulls next once the burst is held (or, wrongly, done).
	for held := false; !held; {
		select {
		case <-done:
			held = true
		default:
			if held = strings.Contains(log.String(), "job output is held"); !held {
				time.Sleep(time.Millisecond)
			}
		}
	}
	got := pullAllFrom(t, j, ts, time.Millisecond, done)
	if len(got) != n-10 {
		t.Fatalf("%d lines delivered after the quiet, want %d", len(got), n-10)
	}
	for i, l := range got {
		if string(l) != line(10+i) {
			t.Fatalf("line %d: %q", 10+i, l)
		}
	}
}

// TestPacerCountsOnlyTheReadersPulls: which pulls refresh the reader's
// grace, on a clock the test moves: the first, one that moves on, one with
// nothing to move on to; not one from behind what was acknowledged.
func TestPacerCountsOnlyTheReadersPulls(t *testing.T) {
	const grace = time.Minute
	behindBy := func(int64) int64 { return 1 } // the reader is always behind
	type pull struct {
		at       time.Duration
		after    int64
		caughtUp bool
	}
	for _, tc := range []struct {
		name  string
		pulls []pull
		at    time.Duration // when the pacer decides
		hold  bool
		keep  int64
	}{
		{"no reader yet", nil, 0, false, keepAll},
		{"first pull from 0", []pull{{0, 0, false}}, 59 * time.Second, true, 0},
		{"first pull, grace over", []pull{{0, 0, false}}, 61 * time.Second, false, keepAll},
		{"stray pulls from 0", []pull{{0, 50, false}, {20 * time.Second, 0, false}, {40 * time.Second, 0, false}, {60 * time.Second, 0, false}},
			61 * time.Second, false, keepAll},
		{"stale pull from where it was", []pull{{0, 50, false}, {50 * time.Second, 50, false}}, 61 * time.Second, false, keepAll},
		{"pull that moves on", []pull{{0, 50, false}, {50 * time.Second, 51, false}}, 61 * time.Second, true, 51},
		{"caught-up reader of a quiet job", []pull{{0, 50, true}, {50 * time.Second, 50, true}}, 61 * time.Second, true, 50},
		{"stray from 0 does not move acked back", []pull{{0, 50, false}, {10 * time.Second, 0, true}}, 61 * time.Second, true, 50},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Unix(1_000_000_000, 0)
			now := start
			p := newPacer(grace)
			p.now = func() time.Time { return now }
			for _, pl := range tc.pulls {
				now = start.Add(pl.at)
				p.ack(pl.after, pl.caughtUp)
			}
			now = start.Add(tc.at)
			p.mu.Lock()
			v := p.decideLocked(behindBy)
			p.mu.Unlock()
			if v.hold > 0 != tc.hold || v.keep != tc.keep {
				t.Fatalf("hold %v keep %d, want hold %v keep %d", v.hold, v.keep, tc.hold, tc.keep)
			}
		})
	}
}

// TestPacerHoldsAtMostMaxHoldInAll: a reader that moves on by one event
// every 30 s holds output while it is behind, for MaxReaderHold in all;
// then output flows (the bound drops the middle) whatever it pulls.
func TestPacerHoldsAtMostMaxHoldInAll(t *testing.T) {
	now := time.Unix(1_000_000_000, 0)
	p := newPacer(time.Minute)
	p.now = func() time.Time { return now }
	behind := func(int64) int64 { return 1 }
	decide := func() verdict {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.decideLocked(behind)
	}
	var after int64
	held := time.Duration(0)
	for step := 0; step < 100; step++ {
		after++
		p.ack(after, false)
		v := decide()
		if v.hold <= 0 {
			if v.keep != keepAll || !v.spent {
				t.Fatalf("after %v held: hold ended with keep %d spent %v", held, v.keep, v.spent)
			}
			break
		}
		if v.hold > time.Minute {
			t.Fatalf("holds for %v at once, past the grace", v.hold)
		}
		now = now.Add(30 * time.Second)
		held += 30 * time.Second
	}
	if held != MaxReaderHold {
		t.Fatalf("held %v in all, want %v", held, MaxReaderHold)
	}
	// Spent for good: a fresh pull that moves on holds nothing.
	now = now.Add(time.Second)
	p.ack(after+1, false)
	if v := decide(); v.hold > 0 || v.keep != keepAll || v.spent {
		t.Fatalf("after the holds were spent: %+v (the end is said once)", v)
	}
	if p.wait(behind) != keepAll {
		t.Fatal("wait held output after the holds were spent")
	}
}
