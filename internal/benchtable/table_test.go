package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

const sampleLog = `machine: 2 cores, 24 GiB, Linux 6.1, Docker 20.10.24
goos: linux
goarch: amd64
pkg: github.com/tandem-run/tandem/e2e
cpu: AMD EPYC
BenchmarkShim64Tasks-2   	       3	61799522631 ns/op	         0 api-errors	      7825 docker-64-same-shape-ms	        76.72 get-task-p99-ms	         1.101 shim/docker-same-shape-ratio
--- BENCH: BenchmarkShim64Tasks-2
    burst_bench_test.go:223: target 64-task burst vs the same containers made directly: 1.18 (want <= 1.10): MISSED
    burst_bench_test.go:224: target GET p99 ms during the burst: 102.72 (want <= 50.00): MISSED
    burst_bench_test.go:223: target 64-task burst vs the same containers made directly: 1.09 (want <= 1.10): ok
    burst_bench_test.go:224: target GET p99 ms during the burst: 76.72 (want <= 50.00): MISSED
BenchmarkTaskStartVsDocker/busybox/host-2         	      20	 253807585 ns/op	         1.029 paired-ratio
--- BENCH: BenchmarkTaskStartVsDocker/busybox/host-2
    startup_bench_test.go:279: target task start vs bare Docker, busybox/host: 1.03 (want <= 1.05): ok
BenchmarkRunnerLogThroughput-2 	 3	 1 ns/op	 0.70 pace-vs-raw
--- BENCH: BenchmarkRunnerLogThroughput-2
    runner_bench_test.go:360: target pipeline pace vs a raw reader: 0.70 (want >= 0.67): ok
BenchmarkFlood/a-2 	 3	 1 ns/op	 5 max-ms
--- BENCH: BenchmarkFlood/a-2
    flood_test.go:167: target healthcheck under the flood, max ms: 5 (want < 1000.00): ok
BenchmarkFlood/b-2 	 3	 1 ns/op	 7 max-ms
--- BENCH: BenchmarkFlood/b-2
    flood_test.go:167: target healthcheck under the flood, max ms: 7 (want < 1000.00): ok
PASS
ok  	github.com/tandem-run/tandem/e2e	45.762s
`

func TestParseKeepsTheLastWordOfEachFigure(t *testing.T) {
	rep, err := Parse(strings.NewReader(sampleLog))
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Benchmarks) != 5 || rep.Benchmarks[1].Name != "TaskStartVsDocker/busybox/host" || rep.Benchmarks[0].Runs != 3 {
		t.Fatalf("benchmarks: %+v", rep.Benchmarks)
	}
	// One figure of two sub-benchmarks is two rows.
	if len(rep.Targets) != 6 || rep.Targets[4].Got != 5 || rep.Targets[5].Got != 7 || rep.Targets[5].Benchmark != "Flood/b" {
		t.Fatalf("targets: %+v", rep.Targets)
	}
	burst := rep.Targets[0]
	if burst.Got != 1.09 || !burst.OK || burst.Op != "<=" || burst.Want != 1.10 || burst.Benchmark != "Shim64Tasks" {
		t.Fatalf("the burst's figure is its last run's: %+v", burst)
	}
	if rep.Missed() != 1 || rep.Targets[1].OK {
		t.Fatalf("missed: %d, %+v", rep.Missed(), rep.Targets[1])
	}
	if rep.Targets[3].Op != ">=" || rep.Targets[3].Benchmark != "RunnerLogThroughput" {
		t.Fatalf("%+v", rep.Targets[3])
	}
	if strings.Join(rep.Machine, "; ") != "2 cores, 24 GiB, Linux 6.1, Docker 20.10.24; cpu: AMD EPYC" {
		t.Fatalf("machine: %q", rep.Machine)
	}
}

func TestRenderNamesTheDateMachineAndMisses(t *testing.T) {
	rep, err := Parse(strings.NewReader(sampleLog))
	if err != nil {
		t.Fatal(err)
	}
	out := Render(rep, time.Date(2026, 11, 26, 4, 5, 0, 0, time.UTC))
	for _, want := range []string{
		"Last `make bench`: 2026-11-26 04:05 UTC, on 2 cores, 24 GiB, Linux 6.1, Docker 20.10.24; cpu: AMD EPYC.",
		"Targets: 5 of 6 met.",
		"| GET p99 ms during the burst | Shim64Tasks | 76.7 | <= 50 | **missed** |",
		"| 64-task burst vs the same containers made directly | Shim64Tasks | 1.09 | <= 1.10 | ok |",
		"| TaskStartVsDocker/busybox/host | 20 | 1.03 paired-ratio |",
		"| Shim64Tasks | 3 | 0 api-errors, 7825 docker-64-same-shape-ms, 76.7 get-task-p99-ms, 1.10 shim/docker-same-shape-ratio |",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("missing %q in:\n%s", want, out)
		}
	}
	if strings.Contains(out, "ns/op") {
		t.Errorf("whole-iteration times are not figures:\n%s", out)
	}
}

func TestParseRefusesALogWithoutResults(t *testing.T) {
	if _, err := Parse(strings.NewReader("FAIL\tgithub.com/x/e2e\t1.2s\n")); err == nil {
		t.Fatal("a log without results must not blank the table")
	}
	if _, err := Parse(strings.NewReader("BenchmarkX-2 3 abc ms\n")); err == nil {
		t.Fatal("a metric that is not a number must be refused")
	}
}

func TestReplaceRewritesOnlyTheMarkedSection(t *testing.T) {
	doc := "# T\n\nbefore\n" + BeginMarker + "\nold table\n" + EndMarker + "\nafter\n"
	out, err := Replace(doc, "new table\n")
	if err != nil {
		t.Fatal(err)
	}
	if out != "# T\n\nbefore\n"+BeginMarker+"\nnew table\n"+EndMarker+"\nafter\n" {
		t.Fatalf("%q", out)
	}
	for _, bad := range []string{"no markers", BeginMarker + EndMarker + BeginMarker, EndMarker + "\n" + BeginMarker} {
		if _, err := Replace(bad, "x"); err == nil {
			t.Fatalf("%q: want an error", bad)
		}
	}
}

func TestRunRewritesTheDoc(t *testing.T) {
	dir := t.TempDir()
	log, doc := filepath.Join(dir, "bench.log"), filepath.Join(dir, "figures.md")
	_ = os.WriteFile(log, []byte(sampleLog), 0o644)
	_ = os.WriteFile(doc, []byte("intro\n"+BeginMarker+"\n"+EndMarker+"\n"), 0o644)
	// Dated by the log: when the bench wrote it.
	ran := time.Date(2026, 11, 26, 0, 0, 0, 0, time.UTC)
	if err := os.Chtimes(log, ran, ran); err != nil {
		t.Fatal(err)
	}
	if err := run(log, doc); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(doc)
	if !strings.HasPrefix(string(b), "intro\n"+BeginMarker+"\nLast `make bench`: 2026-11-26 00:00 UTC") || !strings.HasSuffix(string(b), EndMarker+"\n") {
		t.Fatalf("%s", b)
	}
	// A doc without markers is left as it was.
	_ = os.WriteFile(doc, []byte("no markers\n"), 0o644)
	if err := run(log, doc); err == nil {
		t.Fatal("want an error")
	}
	if b, _ := os.ReadFile(doc); string(b) != "no markers\n" {
		t.Fatalf("changed: %q", b)
	}
}

// A log that go test cut is named in the table: a target of that
// benchmark may be its warm-up run's word.
func TestRenderNamesATruncatedLog(t *testing.T) {
	log := `BenchmarkSSH-2   	20	5 ns/op	0.98 ratio
--- BENCH: BenchmarkSSH-2
    ssh_test.go:1: target ssh down: 1.16 (want >= 1.00): ok
	... [output truncated]
BenchmarkOther-2   	20	5 ns/op	1 x
`
	rep, err := Parse(strings.NewReader(log))
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Truncated) != 1 || rep.Truncated[0] != "SSH" {
		t.Fatalf("truncated: %q", rep.Truncated)
	}
	if out := Render(rep, time.Unix(0, 0)); !strings.Contains(out, "go test cut the log of SSH") {
		t.Fatalf("render does not say so:\n%s", out)
	}
	clean, _ := Parse(strings.NewReader(sampleLog))
	if out := Render(clean, time.Unix(0, 0)); strings.Contains(out, "cut the log") || len(clean.Truncated) != 0 {
		t.Fatal("a whole log is said to be cut")
	}
}

// The doc `make bench-table` rewrites has its markers, once each: a
// bench run must not end in "want one ... marker" after 40 minutes.
func TestFiguresDocHasMarkers(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "docs", "figures.md"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Replace(string(b), "x"); err != nil {
		t.Fatalf("docs/figures.md: %v", err)
	}
}
