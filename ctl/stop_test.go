package ctl

import (
	"context"
	"errors"
	"testing"
)

func TestStopperBeforeTheJobCancelsTheRun(t *testing.T) {
	s := newStopper()
	ctx, cancel := s.begin(context.Background())
	defer cancel(nil)
	s.Stop()
	<-ctx.Done()
	if !errors.Is(context.Cause(ctx), ErrInterrupted) || !interrupted(ctx) {
		t.Fatalf("cause %v, want ErrInterrupted", context.Cause(ctx))
	}
	if len(s.stops) != 0 {
		t.Fatal("a stop before the job runs must not reach the follower")
	}
}

func TestStopperBeforeBeginIsKept(t *testing.T) {
	s := newStopper()
	s.Stop() // a Ctrl-C while the run is being set up
	ctx, cancel := s.begin(context.Background())
	defer cancel(nil)
	if !interrupted(ctx) {
		t.Fatal("a stop that came before the run began was lost")
	}
}

func TestStopperWhileTheJobRunsGoesToTheFollower(t *testing.T) {
	s := newStopper()
	ctx, cancel := s.begin(context.Background())
	defer cancel(nil)
	s.started()
	for range 10 { // many presses never block
		s.Stop()
	}
	if ctx.Err() != nil {
		t.Fatal("a stop while the job runs must not cancel the run: the job is stopped gracefully")
	}
	select {
	case <-s.stops:
	default:
		t.Fatal("the follower got no stop request")
	}
}

// TestNewRunCommandRules: a run with no command is the image's own (its
// ENTRYPOINT and CMD, found once the task runs); an empty entrypoint with
// no command has nothing to run and is refused before anything is made.
func TestNewRunCommandRules(t *testing.T) {
	if _, err := NewRun(testClient(t, Config{Shim: "127.0.0.1:1"}), RunOptions{}); err != nil {
		t.Fatalf("a run of the image's own command was refused: %v", err)
	}
	if _, err := NewRun(testClient(t, Config{Shim: "127.0.0.1:1"}), RunOptions{Entrypoint: []string{}}); !errors.Is(err, ErrNoImageCommand) {
		t.Fatalf("an empty entrypoint and no command: %v", err)
	}
	r, err := NewRun(testClient(t, Config{Shim: "127.0.0.1:1"}), RunOptions{Commands: []string{"true"}})
	if err != nil {
		t.Fatal(err)
	}
	if r.o.Network != "host" || len(r.ID()) != 36 || r.Name() != "tandem-"+r.ID()[:8] {
		t.Fatalf("defaults: network %q id %q name %q", r.o.Network, r.ID(), r.Name())
	}
}

func TestNewClusterChecks(t *testing.T) {
	two := []Node{{Shim: "10.0.0.1:10998"}, {Shim: "10.0.0.2:10998"}}
	cmd := []string{"true"}
	for name, tc := range map[string]struct {
		o     RunOptions
		nodes []Node
	}{
		"one node":       {RunOptions{Commands: cmd}, two[:1]},
		"nothing to run": {RunOptions{Entrypoint: []string{}}, two},
		"detached":       {RunOptions{Commands: cmd, Detach: true}, two},
		"bridge network": {RunOptions{Commands: cmd, Network: "bridge"}, two},
	} {
		if _, err := NewCluster(testClient(t, Config{Shim: tc.nodes[0].Shim}), tc.o, tc.nodes); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	c, err := NewCluster(testClient(t, Config{Shim: two[0].Shim}), RunOptions{Commands: cmd, Name: "train"}, two)
	if err != nil {
		t.Fatal(err)
	}
	if c.o.Network != "host" || len(c.cs) != 2 || c.cs[1].name != "train-1" || c.cs[0].Label != two[0].Shim || c.cs[0].id == c.cs[1].id {
		t.Fatalf("cluster: network %q nodes %+v", c.o.Network, c.cs)
	}
}
