package metrics

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	rtmetrics "runtime/metrics"
	"strconv"
	"strings"

	"github.com/tandem-run/tandem/common/procs"
)

// procStat is what the process_* series say, read from /proc.
type procStat struct {
	cpuSeconds   float64
	startSeconds float64 // since the epoch
	rssBytes     float64
	vsizeBytes   float64
	openFDs      float64
	maxFDs       float64
	threads      float64
}

// userHZ is the clock tick of /proc/*/stat times; 100 on every Linux
// architecture Go supports.
const userHZ = 100

// readProc reads the process at dir (/proc/self) with the boot time from
// statFile (/proc/stat). A field it cannot read stays 0; the scrape goes on.
func readProc(dir, statFile string) (procStat, error) {
	var p procStat
	f, err := procs.StatFields(dir)
	if err != nil {
		return p, err
	}
	// f[0] is field 3 (state): utime is field 14, stime 15, num_threads 20,
	// starttime 22, vsize 23, rss 24 (pages).
	if len(f) < 22 {
		return p, fmt.Errorf("%s/stat: %d fields", dir, len(f)+2)
	}
	num := func(field int) float64 {
		v, _ := strconv.ParseFloat(f[field-3], 64)
		return v
	}
	p.cpuSeconds = (num(14) + num(15)) / userHZ
	p.threads = num(20)
	p.vsizeBytes = num(23)
	p.rssBytes = num(24) * float64(os.Getpagesize())
	if bt := bootTime(statFile); bt > 0 {
		p.startSeconds = bt + num(22)/userHZ
	}
	if ents, err := os.ReadDir(filepath.Join(dir, "fd")); err == nil {
		p.openFDs = float64(len(ents))
	}
	p.maxFDs = maxFDs(filepath.Join(dir, "limits"))
	return p, nil
}

func bootTime(statFile string) float64 {
	f, err := os.Open(statFile)
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "btime "); ok {
			n, _ := strconv.ParseFloat(strings.TrimSpace(v), 64)
			return n
		}
	}
	return 0
}

func maxFDs(limits string) float64 {
	b, err := os.ReadFile(limits)
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "Max open files"); ok {
			if f := strings.Fields(rest); len(f) > 0 {
				n, _ := strconv.ParseFloat(f[0], 64)
				return n
			}
		}
	}
	return 0
}

// runtimeSamples are the Go runtime's own figures, read without stopping
// the world (runtime.ReadMemStats would).
var runtimeSamples = []struct{ metric, name, help string }{
	{"/memory/classes/heap/objects:bytes", "go_memstats_heap_alloc_bytes", "Bytes of allocated heap objects."},
	{"/memory/classes/total:bytes", "go_memstats_sys_bytes", "Bytes of memory obtained from the OS."},
	{"/memory/classes/heap/released:bytes", "go_memstats_heap_released_bytes", "Heap bytes released to the OS."},
	{"/gc/heap/goal:bytes", "go_memstats_next_gc_bytes", "Heap size the next garbage collection aims at."},
	{"/sched/goroutines:goroutines", "go_goroutines", "Goroutines that currently exist."},
	{"/gc/gomemlimit:bytes", "go_gc_gomemlimit_bytes", "The Go runtime's soft memory limit."},
	{"/gc/gogc:percent", "go_gc_gogc_percent", "The Go runtime's GOGC."},
}

// gcCycles is a counter, written apart from the gauges above.
const gcCycles = "/gc/cycles/total:gc-cycles"

func writeRuntime(w *bufio.Writer) {
	s := make([]rtmetrics.Sample, len(runtimeSamples)+1)
	for i, r := range runtimeSamples {
		s[i].Name = r.metric
	}
	s[len(runtimeSamples)].Name = gcCycles
	rtmetrics.Read(s)
	for i, r := range runtimeSamples {
		gaugeLine(w, r.name, r.help, gauge, sampleFloat(s[i].Value))
	}
	gaugeLine(w, "go_gc_cycles_total", "Completed garbage collection cycles.", counter, sampleFloat(s[len(runtimeSamples)].Value))
	gaugeLine(w, "go_info", "Information about the Go environment.", gauge, 1, "version", runtime.Version())
}

func sampleFloat(v rtmetrics.Value) float64 {
	switch v.Kind() {
	case rtmetrics.KindUint64:
		return float64(v.Uint64())
	case rtmetrics.KindFloat64:
		return v.Float64()
	}
	return 0
}

func writeProcess(w *bufio.Writer, p procStat) {
	gaugeLine(w, "process_cpu_seconds_total", "Total user and system CPU time spent in seconds.", counter, p.cpuSeconds)
	gaugeLine(w, "process_open_fds", "Number of open file descriptors.", gauge, p.openFDs)
	gaugeLine(w, "process_max_fds", "Maximum number of open file descriptors.", gauge, p.maxFDs)
	gaugeLine(w, "process_resident_memory_bytes", "Resident memory size in bytes.", gauge, p.rssBytes)
	gaugeLine(w, "process_virtual_memory_bytes", "Virtual memory size in bytes.", gauge, p.vsizeBytes)
	gaugeLine(w, "process_start_time_seconds", "Start time of the process since unix epoch in seconds.", gauge, p.startSeconds)
	gaugeLine(w, "go_threads", "Number of OS threads created.", gauge, p.threads)
}
