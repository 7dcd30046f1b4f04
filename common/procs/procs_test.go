package procs

import (
	"runtime"
	"testing"
)

func TestFor(t *testing.T) {
	for cpus, want := range map[int]int{0: 1, 1: 1, 2: 1, 4: 1, 7: 1, 8: 2, 12: 3, 16: 4, 64: 4, 256: 4} {
		if got := For(cpus); got != want {
			t.Errorf("For(%d) = %d, want %d", cpus, got, want)
		}
	}
}

func TestSetLeavesTheEnvironmentsValue(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	runtime.GOMAXPROCS(3)
	if got := Set(func(k string) string {
		if k == "GOMAXPROCS" {
			return "3"
		}
		return ""
	}); got != 3 || runtime.GOMAXPROCS(0) != 3 {
		t.Fatalf("GOMAXPROCS from the environment overridden: Set %d, now %d", got, runtime.GOMAXPROCS(0))
	}
	runtime.GOMAXPROCS(16)
	if got := Set(func(string) string { return "" }); got != 4 || runtime.GOMAXPROCS(0) != 4 {
		t.Fatalf("16 CPUs: Set %d, now %d; want 4", got, runtime.GOMAXPROCS(0))
	}
}
