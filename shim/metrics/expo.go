package metrics

import (
	"bufio"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
)

// The Prometheus text format (version 0.0.4), written by hand: the shim has
// a dozen families, and client_golang with its protobuf model was 46 of the
// binary's 378 packages, every one of them initialised at start and paged in
// on a host that is never scraped.

type kind string

const (
	counter   kind = "counter"
	gauge     kind = "gauge"
	histogram kind = "histogram"
)

// family is one metric name with its series, keyed by label values.
type family struct {
	name, help string
	kind       kind
	labels     []string
	buckets    []float64 // histograms: upper bounds, ascending, no +Inf

	mu     sync.Mutex // guards series
	series map[string]*series
}

// series is one set of label values. Counters and gauges use v;
// histograms use counts (one per bucket, not cumulative), sum and n.
type series struct {
	values []string
	v      float64
	counts []uint64
	sum    float64
	n      uint64
}

func newFamily(name, help string, k kind, buckets []float64, labels ...string) *family {
	return &family{name: name, help: help, kind: k, labels: labels, buckets: buckets, series: map[string]*series{}}
}

// with returns the series of these label values, made on first use. The
// caller holds f.mu. A wrong count of values is a programming error: the
// values are padded or cut so the exposition stays valid.
func (f *family) with(values ...string) *series {
	key := strings.Join(values, "\xff")
	s := f.series[key]
	if s == nil {
		vs := make([]string, len(f.labels))
		copy(vs, values)
		s = &series{values: vs}
		if f.kind == histogram {
			s.counts = make([]uint64, len(f.buckets))
		}
		f.series[key] = s
	}
	return s
}

// add adds d to a counter or gauge series.
func (f *family) add(d float64, values ...string) {
	f.mu.Lock()
	f.with(values...).v += d
	f.mu.Unlock()
}

// set sets a gauge series.
func (f *family) set(v float64, values ...string) {
	f.mu.Lock()
	f.with(values...).v = v
	f.mu.Unlock()
}

// observe records one histogram sample.
func (f *family) observe(v float64, values ...string) {
	f.mu.Lock()
	s := f.with(values...)
	if i, _ := slices.BinarySearch(f.buckets, v); i < len(s.counts) {
		s.counts[i]++
	}
	s.sum += v
	s.n++
	f.mu.Unlock()
}

// reset drops every series.
func (f *family) reset() {
	f.mu.Lock()
	clear(f.series)
	f.mu.Unlock()
}

// write writes the family, series sorted by label values so that two
// scrapes of the same state are byte-identical.
func (f *family) write(w *bufio.Writer) {
	f.mu.Lock()
	defer f.mu.Unlock()
	header(w, f.name, f.help, f.kind)
	keys := make([]string, 0, len(f.series))
	for k := range f.series {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		s := f.series[k]
		if f.kind != histogram {
			sample(w, f.name, f.labels, s.values, "", "", s.v)
			continue
		}
		var cum uint64
		for i, ub := range f.buckets {
			cum += s.counts[i]
			sample(w, f.name+"_bucket", f.labels, s.values, "le", formatFloat(ub), float64(cum))
		}
		sample(w, f.name+"_bucket", f.labels, s.values, "le", "+Inf", float64(s.n))
		sample(w, f.name+"_sum", f.labels, s.values, "", "", s.sum)
		sample(w, f.name+"_count", f.labels, s.values, "", "", float64(s.n))
	}
}

func header(w *bufio.Writer, name, help string, k kind) {
	w.WriteString("# HELP ")
	w.WriteString(name)
	w.WriteByte(' ')
	w.WriteString(escapeHelp(help))
	w.WriteString("\n# TYPE ")
	w.WriteString(name)
	w.WriteByte(' ')
	w.WriteString(string(k))
	w.WriteByte('\n')
}

// sample writes one line; extraName/extraValue is the histogram's le.
func sample(w *bufio.Writer, name string, labels, values []string, extraName, extraValue string, v float64) {
	w.WriteString(name)
	if len(labels) > 0 || extraName != "" {
		w.WriteByte('{')
		for i, l := range labels {
			if i > 0 {
				w.WriteByte(',')
			}
			w.WriteString(l)
			w.WriteString(`="`)
			w.WriteString(escapeLabel(values[i]))
			w.WriteByte('"')
		}
		if extraName != "" {
			if len(labels) > 0 {
				w.WriteByte(',')
			}
			w.WriteString(extraName)
			w.WriteString(`="`)
			w.WriteString(extraValue)
			w.WriteByte('"')
		}
		w.WriteByte('}')
	}
	w.WriteByte(' ')
	w.WriteString(formatFloat(v))
	w.WriteByte('\n')
}

// gaugeLine writes a whole one-series gauge or counter family.
func gaugeLine(w *bufio.Writer, name, help string, k kind, v float64, labels ...string) {
	header(w, name, help, k)
	var names, values []string
	for i := 0; i+1 < len(labels); i += 2 {
		names, values = append(names, labels[i]), append(values, labels[i+1])
	}
	sample(w, name, names, values, "", "", v)
}

func formatFloat(v float64) string {
	switch {
	case math.IsInf(v, 1):
		return "+Inf"
	case math.IsInf(v, -1):
		return "-Inf"
	case math.IsNaN(v):
		return "NaN"
	}
	return strconv.FormatFloat(v, 'g', -1, 64)
}

var (
	labelEscaper = strings.NewReplacer(`\`, `\\`, "\n", `\n`, `"`, `\"`)
	helpEscaper  = strings.NewReplacer(`\`, `\\`, "\n", `\n`)
)

func escapeLabel(s string) string { return labelEscaper.Replace(s) }
func escapeHelp(s string) string  { return helpEscaper.Replace(s) }

// flushTo writes the buffered exposition; a client that went away is not
// an error worth more than the write's own.
func flushTo(w io.Writer, write func(*bufio.Writer)) error {
	bw := bufio.NewWriterSize(w, 16<<10)
	write(bw)
	return bw.Flush()
}
