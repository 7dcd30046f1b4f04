package main

import "testing"

func TestProcs(t *testing.T) {
	for cpus, want := range map[int]int{0: 1, 1: 1, 2: 1, 4: 1, 7: 1, 8: 2, 12: 3, 16: 4, 64: 4, 256: 4} {
		if got := procs(cpus); got != want {
			t.Errorf("procs(%d) = %d, want %d", cpus, got, want)
		}
	}
}
