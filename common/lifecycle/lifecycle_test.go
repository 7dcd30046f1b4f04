package lifecycle

import (
	"context"
	"errors"
	"slices"
	"testing"
)

func TestStopRunsInReverseOnce(t *testing.T) {
	var s Stack
	var got []int
	for i := range 3 {
		s.OnStop(func() { got = append(got, i) })
	}
	s.Stop()
	s.Stop()
	if !slices.Equal(got, []int{2, 1, 0}) {
		t.Fatalf("stop order %v, want [2 1 0] once", got)
	}
}

// Steps start in order; the first that fails ends the start, named, and
// no later step runs.
func TestStartStopsAtTheFirstFailure(t *testing.T) {
	var s Stack
	var ran []string
	step := func(name string, err error) Step {
		return Step{Name: name, Start: func(context.Context) error { ran = append(ran, name); return err }}
	}
	err := s.Start(context.Background(), step("log", nil), step("api", errors.New("listen: address in use")), step("systemd", nil))
	if err == nil || err.Error() != "api: listen: address in use" || !slices.Equal(ran, []string{"log", "api"}) {
		t.Fatalf("%v, ran %v", err, ran)
	}
}
