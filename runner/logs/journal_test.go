package logs

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
)

func openJournal(t *testing.T, now func() time.Time) *Journal {
	t.Helper()
	j, err := OpenJournal(t.TempDir(), JournalConfig{Now: now})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { j.Close() })
	return j
}

// TestSinceCapKeepsEverything: pulls capped at 100 bytes deliver every
// byte of both log streams, in order, and the states, with last_updated
// never going back.
func TestSinceCapKeepsEverything(t *testing.T) {
	j := openJournal(t, nil)
	for i := 0; i < 10; i++ {
		j.AppendJobLog([]byte(strings.Repeat("j", 30)))
		j.AppendRunnerLog([]byte(strings.Repeat("r", 10)))
	}
	if err := j.AppendState(api.JobStateEvent{State: api.JobRunning}); err != nil {
		t.Fatal(err)
	}
	if err := j.AppendState(api.JobStateEvent{State: api.JobDone}); err != nil {
		t.Fatal(err)
	}
	var total, pulls int
	var ts int64
	var states []api.JobState
	for {
		w, err := j.Since(ts, 100)
		if err != nil {
			t.Fatal(err)
		}
		pulls++
		size := 0
		for _, e := range append(w.JobLogs, w.RunnerLogs...) {
			size += len(e.Data)
			if e.Timestamp <= ts || e.Timestamp > w.LastUpdated {
				t.Fatalf("event at %d outside (%d, %d]", e.Timestamp, ts, w.LastUpdated)
			}
		}
		if size > 100 {
			t.Fatalf("answer of %d bytes over the 100-byte cap", size)
		}
		total += size
		for _, s := range w.States {
			states = append(states, s.State)
		}
		if w.LastUpdated < ts {
			t.Fatal("last_updated went back")
		}
		ts = w.LastUpdated
		if len(w.JobLogs)+len(w.RunnerLogs)+len(w.States) == 0 {
			break
		}
		if pulls > 50 {
			t.Fatal("pull loop does not converge")
		}
	}
	if total != 400 || len(states) != 2 || states[1] != api.JobDone || pulls < 4 {
		t.Fatalf("total %d states %v pulls %d", total, states, pulls)
	}
	// One event larger than the cap still comes, alone.
	j.AppendJobLog(bytes.Repeat([]byte("x"), 500))
	if w, err := j.Since(ts, 100); err != nil || len(w.JobLogs) != 1 || len(w.JobLogs[0].Data) != 500 {
		t.Fatalf("oversized event: %+v %v", w, err)
	}
}

func TestJournalStateTable(t *testing.T) {
	j := openJournal(t, nil)
	if err := j.AppendState(api.JobStateEvent{State: api.JobDone}); !errors.Is(err, ErrTransition) {
		t.Fatalf("done before running: %v", err)
	}
	_ = j.AppendState(api.JobStateEvent{State: api.JobRunning})
	_ = j.AppendState(api.JobStateEvent{State: api.JobTerminated})
	if err := j.AppendState(api.JobStateEvent{State: api.JobDone}); !errors.Is(err, ErrTransition) || j.LastState() != api.JobTerminated {
		t.Fatalf("after the end: %v %s", err, j.LastState())
	}
}

func TestQuotaHourBuckets(t *testing.T) {
	now := time.Unix(0, 0)
	q := &Quota{PerHour: 100, Start: now, Now: func() time.Time { return now }}
	if !q.Charge(60) || q.Charge(50) || !q.Charge(40) {
		t.Fatal("within an hour the quota is shared")
	}
	now = now.Add(time.Hour)
	if !q.Charge(100) {
		t.Fatal("a new hour resets the quota")
	}
	if !(&Quota{}).Charge(1<<30) || !(*Quota)(nil).Charge(1) {
		t.Fatal("0 or none means unlimited")
	}
}

// TestPipe: raw bytes reach the history, stripped lines the journal; past
// the quota nothing more is stored and QuotaHit closes.
func TestPipe(t *testing.T) {
	j := openJournal(t, nil)
	hist, err := OpenHistory(t.TempDir()+"/job.log", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer hist.Close()
	p := j.Pipe(hist, &Quota{PerHour: 1000, Start: time.Now()}, nil)
	_, _ = p.Write([]byte("\x1b[31mred\x1b[0m line\r\n"))
	_, _ = p.Write([]byte("partial"))
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	w, _ := j.Since(0, 1<<20)
	var got bytes.Buffer
	for _, e := range w.JobLogs {
		got.Write(e.Data)
	}
	if got.String() != "red line\npartial" && got.String() != "red line\npartial\n" {
		t.Fatalf("stripped %q", got.String())
	}
	if hist.Size() != int64(len("\x1b[31mred\x1b[0m line\r\npartial")) {
		t.Fatalf("history holds %d bytes", hist.Size())
	}
	select {
	case <-p.QuotaHit():
		t.Fatal("quota hit below the quota")
	default:
	}
	p = j.Pipe(hist, &Quota{PerHour: 10, Start: time.Now()}, nil)
	_, _ = p.Write([]byte(strings.Repeat("y", 50) + "\n"))
	_ = p.Close()
	select {
	case <-p.QuotaHit():
	case <-time.After(time.Second):
		t.Fatal("quota not hit")
	}
}

// TestStripperMultibyteLines: lines of multi-byte runes among ASCII ones
// come out whole (the flush sizes its buffer for ASCII).
func TestStripperMultibyteLines(t *testing.T) {
	var out bytes.Buffer
	s := NewStripper(func(b []byte) { out.Write(b) })
	in := strings.Repeat("héllo wörld ✓✓✓\r\nplain ascii\r\n", 50)
	_, _ = s.Write([]byte(in))
	_ = s.Close()
	if want := strings.ReplaceAll(in, "\r\n", "\n"); out.String() != want {
		t.Fatalf("got %q", out.String()[:80])
	}
}

// LastState is the latest recorded job state ("" before any).
func (j *Journal) LastState() api.JobState {
	j.mu.Lock()
	defer j.mu.Unlock()
	if n := len(j.states); n > 0 {
		return j.states[n-1].State
	}
	return ""
}

// BeforeFinal gets the job's final state, stamped as it is recorded,
// once, and only when the state is allowed; no other state reaches it.
// It runs before the state is recorded: what it leaves (the shim's state
// file) is there before any reader of the journal learns the job ended.
func TestBeforeFinalGetsTheEndBeforeItIsRecorded(t *testing.T) {
	var got []api.JobStateEvent
	var j *Journal
	var recordedBefore []int
	j, err := OpenJournal(t.TempDir(), JournalConfig{BeforeFinal: func(ev api.JobStateEvent) {
		got = append(got, ev)
		recordedBefore = append(recordedBefore, len(j.states)) // j.mu is held: read directly
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer j.Close()
	_ = j.AppendState(api.JobStateEvent{State: api.JobDone}) // refused: not running yet
	_ = j.AppendState(api.JobStateEvent{State: api.JobRunning})
	code := 3
	if err := j.AppendState(api.JobStateEvent{State: api.JobFailed, ExitStatus: &code}); err != nil {
		t.Fatal(err)
	}
	_ = j.AppendState(api.JobStateEvent{State: api.JobTerminated}) // refused: after the end
	states, _ := j.StatesSince(0)
	if len(got) != 1 || got[0].State != api.JobFailed || got[0].Timestamp == 0 || len(states) != 2 || got[0].Timestamp != states[1].Timestamp {
		t.Fatalf("BeforeFinal got %+v; recorded %+v", got, states)
	}
	if recordedBefore[0] != 1 {
		t.Fatalf("the final state was recorded before BeforeFinal ran: %d states then", recordedBefore[0])
	}
}
