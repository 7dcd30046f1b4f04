package lifecycle

import (
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
