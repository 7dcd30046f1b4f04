package ctl

import (
	"testing"
	"time"
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
