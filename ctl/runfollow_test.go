package ctl

import (
	"bytes"
	"context"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/tandem-run/tandem/api"
)

// stepClock hands each wait to the test, which decides when it passes.
type stepClock struct{ waits chan chan time.Time }

func (c *stepClock) Now() time.Time { return time.Time{} }

func (c *stepClock) After(time.Duration) <-chan time.Time {
	ch := make(chan time.Time, 1)
	c.waits <- ch
	return ch
}

// At a job's end, the run waits for its output as long as output keeps
// arriving (a job is not held for its watcher, so the stream may be well
// behind), and no longer once a whole outputStall brought nothing; a
// stream that ends ends the wait at once.
func TestDrainOutputWaitsWhileOutputArrives(t *testing.T) {
	clk := &stepClock{waits: make(chan chan time.Time)}
	moved, done, returned := make(chan struct{}, 1), make(chan struct{}), make(chan struct{})
	moved <- struct{}{} // output before the end does not count
	go func() { drainOutput(clk, done, moved); close(returned) }()
	for range 3 {
		w := <-clk.waits
		moved <- struct{}{} // output arrived during this wait
		w <- time.Time{}
	}
	select {
	case <-returned:
		t.Fatal("gave up while output was arriving")
	case w := <-clk.waits: // a fourth wait: nothing arrives in it
		w <- time.Time{}
	}
	select {
	case <-returned:
	case <-time.After(10 * time.Second):
		t.Fatal("did not give up after a wait without output")
	}

	returned = make(chan struct{})
	go func() { drainOutput(clk, done, moved); close(returned) }()
	<-clk.waits
	close(done)
	select {
	case <-returned:
	case <-time.After(10 * time.Second):
		t.Fatal("the stream's end did not end the wait")
	}
}

// A short job's end is seen when its output stream ends, not after the
// state poll's slow pace: here that pace never comes (the clock is
// stuck), and the run still ends with the job's final state and all of
// its output. The runner writes the final state a moment after the
// stream ends, as a real one may: the quick looks that follow find it.
func TestRunSeesTheJobEndWhenItsOutputEnds(t *testing.T) {
	ended := make(chan struct{})
	var done atomic.Bool // the final state is written
	var pulls atomic.Int32
	r := testRunner(t, func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/logs_ws":
			conn, err := (&websocket.Upgrader{}).Upgrade(w, r, nil)
			if err != nil {
				return
			}
			defer conn.Close()
			_ = conn.WriteMessage(websocket.BinaryMessage, []byte("hello\n"))
			<-ended
			_ = conn.WriteMessage(websocket.BinaryMessage, []byte("bye\n"))
			_ = conn.WriteControl(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""), time.Now().Add(time.Second))
			go func() { time.Sleep(50 * time.Millisecond); done.Store(true) }()
		case "/api/pull":
			if r.URL.Query().Get("logs") != "0" || r.URL.Query().Get("peek") != "" {
				http.Error(w, "the run's watch must pull states only, as the job's driver", http.StatusBadRequest)
				return
			}
			pulls.Add(1)
			states := `[{"state":"running","timestamp":1,"termination_reason":"","termination_message":""}`
			if done.Load() {
				states += `,{"state":"done","timestamp":2,"termination_reason":"done_by_runner","termination_message":"","exit_status":0}`
			}
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"job_states":` + states + `],"job_logs":[],"runner_logs":[],"last_updated":0,"has_more":false}`))
		default:
			http.NotFound(w, r)
		}
	})
	clk := &quickOnlyClock{slow: statePoll}
	var out syncBuffer
	var res Result
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	go func() {
		for !strings.Contains(out.String(), "hello") {
			time.Sleep(5 * time.Millisecond)
		}
		time.Sleep(50 * time.Millisecond) // the watch waits at its slow pace
		close(ended)
	}()
	err := pullWatch(clk, r, time.Time{}, &out).run(ctx, &res)
	if err != nil {
		t.Fatalf("watch: %v (after %d pulls)", err, pulls.Load())
	}
	if res.State != api.JobDone || out.String() != "hello\nbye\n" {
		t.Fatalf("ended %q with output %q", res.State, out.String())
	}
}

// quickOnlyClock passes every wait shorter than slow at once (and reads
// that much later), and never passes a wait of slow or longer.
type quickOnlyClock struct {
	slow time.Duration
	mu   sync.Mutex
	now  time.Time
}

func (c *quickOnlyClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *quickOnlyClock) After(d time.Duration) <-chan time.Time {
	ch := make(chan time.Time, 1)
	if d >= c.slow {
		return ch
	}
	time.Sleep(time.Millisecond) // a real runner's moment: no busy spin
	c.mu.Lock()
	c.now = c.now.Add(d)
	ch <- c.now
	c.mu.Unlock()
	return ch
}

// syncBuffer is a bytes.Buffer safe for a writer and a reader together.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// A Tandem runner says how the job ended at its output stream's end
// (asked with tandem_end=1): the watch ends there with that state and all
// of the output, and asks for no state after the stream ended (a round
// trip less over a long link). Here the runner's pulls never say the job
// ended: only the stream's end can.
func TestWatchEndsWithTheStreamsEndState(t *testing.T) {
	var pullsAfterEnd atomic.Int32
	var ended atomic.Bool
	r := testRunner(t, func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/logs_ws":
			if r.URL.Query().Get(api.LogsEndParam) != "1" {
				http.Error(w, "the watch must ask for the end state", http.StatusBadRequest)
				return
			}
			conn, err := (&websocket.Upgrader{}).Upgrade(w, r, nil)
			if err != nil {
				return
			}
			defer conn.Close()
			_ = conn.WriteMessage(websocket.BinaryMessage, []byte("hello\n"))
			_ = conn.WriteMessage(websocket.TextMessage, []byte(`{"tandem_end":{"state":"failed","timestamp":2,"termination_reason":"container_exited_with_error","termination_message":"","exit_status":3}}`))
			ended.Store(true)
			_ = conn.WriteControl(websocket.CloseMessage, []byte{}, time.Now().Add(time.Second))
		case "/api/pull":
			if ended.Load() {
				pullsAfterEnd.Add(1)
			}
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"job_states":[{"state":"running","timestamp":1,"termination_reason":"","termination_message":""}],"job_logs":[],"runner_logs":[],"last_updated":1,"has_more":false}`))
		default:
			http.NotFound(w, r)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var out syncBuffer
	var res Result
	if err := pullWatch(&quickOnlyClock{slow: statePoll}, r, time.Time{}, &out).run(ctx, &res); err != nil {
		t.Fatal(err)
	}
	if res.ExitStatus == nil || *res.ExitStatus != 3 || out.String() != "hello\n" {
		t.Fatalf("result %+v, output %q", res, out.String())
	}
	if n := pullsAfterEnd.Load(); n > 1 { // one may be under way as the stream ends
		t.Fatalf("%d state pulls after the stream said how the job ended", n)
	}
}
