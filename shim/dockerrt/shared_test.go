package dockerrt

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestSharedCallsOnceForConcurrentCallers(t *testing.T) {
	var s shared[bool]
	var calls atomic.Int32
	release := make(chan struct{})
	f := func(context.Context) (bool, error) {
		calls.Add(1)
		<-release
		return true, nil
	}
	var wg sync.WaitGroup
	results := make(chan bool, 16)
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			v, err := s.do(context.Background(), "img", f)
			if err != nil {
				t.Error(err)
			}
			results <- v
		}()
	}
	// Every caller has joined before the call returns.
	for deadline := time.Now().Add(5 * time.Second); calls.Load() == 0 && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond)
	close(release)
	wg.Wait()
	close(results)
	for v := range results {
		if !v {
			t.Fatal("a caller got another answer")
		}
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("%d calls for one burst, want 1", n)
	}
	// Nothing is kept: the next caller asks again.
	if _, err := s.do(context.Background(), "img", func(context.Context) (bool, error) { calls.Add(1); return false, nil }); err != nil || calls.Load() != 2 {
		t.Fatalf("a later caller was answered from memory (%d calls, %v)", calls.Load(), err)
	}
}

func TestSharedCallerThatGivesUp(t *testing.T) {
	var s shared[bool]
	release := make(chan struct{})
	var callCtx context.Context
	started := make(chan struct{})
	go func() {
		_, _ = s.do(context.Background(), "img", func(ctx context.Context) (bool, error) {
			callCtx = ctx
			close(started)
			<-release
			return true, nil
		})
	}()
	<-started
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := s.do(ctx, "img", nil); !errors.Is(err, context.Canceled) {
		t.Fatalf("a caller that gave up: %v", err)
	}
	if callCtx.Err() != nil {
		t.Fatal("one caller giving up cancelled the shared call")
	}
	close(release)
}

func TestSharedForgetStartsAFreshCall(t *testing.T) {
	var s shared[bool]
	release := make(chan struct{})
	started := make(chan struct{})
	go func() {
		_, _ = s.do(context.Background(), "img", func(context.Context) (bool, error) {
			close(started)
			<-release
			return false, nil // asked before a pull ended: missing
		})
	}()
	<-started
	s.forget("img") // the pull ended
	v, err := s.do(context.Background(), "img", func(context.Context) (bool, error) { return true, nil })
	if err != nil || !v {
		t.Fatalf("after forget a caller joined the older call: %v %v", v, err)
	}
	close(release)
}
