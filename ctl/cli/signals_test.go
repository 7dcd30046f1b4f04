package cli

import (
	"syscall"
	"testing"
	"time"
)

func TestOnSignalsFirstThenAgain(t *testing.T) {
	first, again := make(chan struct{}, 4), make(chan struct{}, 4)
	stop := onSignals(func() { first <- struct{}{} }, func() { again <- struct{}{} })
	defer stop()
	wait := func(c chan struct{}, what string) {
		t.Helper()
		select {
		case <-c:
		case <-time.After(10 * time.Second):
			t.Fatalf("%s was not called", what)
		}
	}
	if err := syscall.Kill(syscall.Getpid(), syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	wait(first, "first")
	if err := syscall.Kill(syscall.Getpid(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	wait(again, "again")
	if len(first) != 0 {
		t.Fatal("first was called twice")
	}
}
