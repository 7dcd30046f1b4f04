package logs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// blocksOnDisk is the file's allocated size.
func blocksOnDisk(t *testing.T, path string) int64 {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Sys().(*syscall.Stat_t).Blocks * 512
}

// line i of a test stream: never a zero byte, so a read of a hole shows.
func line(i int) string { return fmt.Sprintf("line %09d %s\n", i, strings.Repeat("x", 80)) }

// TestHistoryKeepsHeadAndLatest: 40 MiB through a history retaining 8 MiB
// (2 MiB head) leaves at most that (plus a punch step) on disk; a reader
// from the start gets the head, one marker saying how much was dropped,
// then exactly the newest output, and the file's size is still logical.
func TestHistoryKeepsHeadAndLatest(t *testing.T) {
	path := t.TempDir() + "/job.log"
	r := Retention{Head: 2 << 20, Max: 8 << 20}
	h, err := OpenHistoryRetained(path, nil, r)
	if err != nil {
		t.Fatal(err)
	}
	var all bytes.Buffer
	for i := 0; all.Len() < 40<<20; i++ {
		l := line(i)
		all.WriteString(l)
		if _, err := h.Write([]byte(l)); err != nil {
			t.Fatal(err)
		}
	}
	if err := h.Close(); err != nil {
		t.Fatal(err)
	}
	if got := blocksOnDisk(t, path); got > r.Max+punchStep+historyTail+64<<10 {
		t.Fatalf("%d bytes on disk for a retention of %d", got, r.Max)
	}
	if fi, _ := os.Stat(path); fi.Size() != int64(all.Len()) {
		t.Fatalf("logical size %d, wrote %d", fi.Size(), all.Len())
	}
	var got bytes.Buffer
	rd := h.Reader(time.Time{})
	for {
		b, err := rd.Next(context.Background(), 1<<20)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		got.Write(b)
	}
	g := got.Bytes()
	if bytes.IndexByte(g, 0) >= 0 {
		t.Fatal("a reader got bytes of a hole")
	}
	want := all.Bytes()
	if !bytes.HasPrefix(g, want[:r.Head]) {
		t.Fatal("the head is not the start of the output")
	}
	i := bytes.Index(g, []byte("[tandem: "))
	j := bytes.Index(g, []byte("bytes]\r\n"))
	if i != int(r.Head)+2 || j < i {
		t.Fatalf("no marker right after the head: %d %d", i, j)
	}
	var skipped int64
	fmt.Sscanf(string(g[i:]), "[tandem: %d bytes", &skipped)
	rest := g[j+len("bytes]\r\n"):]
	if int64(len(rest))+skipped+r.Head != int64(len(want)) || !bytes.HasSuffix(want, rest) {
		t.Fatalf("after the marker: %d bytes, skipped %d, head %d, total %d", len(rest), skipped, r.Head, len(want))
	}
	if int64(len(rest)) < r.Max-r.Head-punchStep {
		t.Fatalf("only %d of the latest output kept", len(rest))
	}
	// Memory: index entries inside the hole went.
	if len(h.offs) > 0 && h.offs[len(h.offs)-1] < h.trim.dropEnd && len(h.offs) > 2 {
		t.Fatalf("index points into the hole: %v", h.offs)
	}
}

// TestHistoryReaderRacesPunches: a reader that follows a fast writer never
// returns a byte of a hole, and every byte it returns is output in order.
func TestHistoryReaderRacesPunches(t *testing.T) {
	h, err := OpenHistoryRetained(t.TempDir()+"/job.log", nil, Retention{Head: 64 << 10, Max: 3 << 20})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := range 400000 {
			_, _ = h.Write([]byte(line(i)))
		}
		_ = h.Close()
	}()
	rd := h.Reader(time.Time{})
	var last int = -1
	var carry []byte
	for {
		b, err := rd.Next(context.Background(), 4096) // a slow, small reader
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if bytes.IndexByte(b, 0) >= 0 {
			t.Fatal("read a hole")
		}
		if bytes.HasPrefix(b, []byte("\r\n[tandem:")) {
			carry = nil
			continue
		}
		carry = append(carry, b...)
		for {
			k := bytes.IndexByte(carry, '\n')
			if k < 0 {
				break
			}
			var n int
			if _, err := fmt.Sscanf(string(carry[:k]), "line %d", &n); err == nil {
				if n <= last {
					t.Fatalf("line %d after %d", n, last)
				}
				last = n
			}
			carry = carry[k+1:]
		}
	}
	wg.Wait()
	if last != 399999 {
		t.Fatalf("last line read %d", last)
	}
}

// TestStoreKeepsFirstAndNewestEvents: the stripped log store drops whole
// events from the middle; what is pulled is the first events and the
// newest, in order, and memory holds only their index.
func TestStoreKeepsFirstAndNewestEvents(t *testing.T) {
	path := t.TempDir() + "/job_logs.events"
	r := Retention{Head: 1 << 20, Max: 4 << 20}
	s, err := OpenStoreRetained(path, r)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	n := 0
	for ts := int64(1); n < 30<<20; ts++ {
		l := line(int(ts))
		if err := s.Append(ts, []byte(l)); err != nil {
			t.Fatal(err)
		}
		n += len(l)
	}
	if got := blocksOnDisk(t, path); got > r.Max+2*punchStep {
		t.Fatalf("%d bytes on disk", got)
	}
	if s.OnDisk() > r.Max+punchStep {
		t.Fatalf("OnDisk %d", s.OnDisk())
	}
	evs, _, err := s.After(0, 1<<62, 64<<20)
	if err != nil {
		t.Fatal(err)
	}
	if s.Len() != len(evs) || s.Len() > int(r.Max+punchStep)/len(line(0))+10 {
		t.Fatalf("index holds %d events", s.Len())
	}
	var prev int64
	markers := 0
	for i, e := range evs {
		if e.Timestamp <= prev {
			t.Fatalf("event %d: ts %d after %d", i, e.Timestamp, prev)
		}
		if bytes.HasPrefix(e.Data, []byte("[tandem: ")) {
			// The marker stands where the middle went, says how much, and
			// carries the last dropped event's stamp.
			markers++
			var dropped int64
			if _, err := fmt.Sscanf(string(e.Data), "[tandem: %d bytes of output were dropped here", &dropped); err != nil || dropped < 25<<20 {
				t.Fatalf("marker %q (%v)", e.Data, err)
			}
			if next := evs[i+1].Timestamp; next != e.Timestamp+1 {
				t.Fatalf("marker stamped %d, next kept event %d", e.Timestamp, next)
			}
		} else if string(e.Data) != line(int(e.Timestamp)) {
			t.Fatalf("event %d: %q", i, e.Data)
		}
		prev = e.Timestamp
	}
	if markers != 1 {
		t.Fatalf("%d markers, want one where the middle was dropped", markers)
	}
	if evs[0].Timestamp != 1 || evs[len(evs)-1].Timestamp != prev {
		t.Fatal("first or newest event missing")
	}
}

// TestQuotaCountsRawBytes: output that strips to nothing (escape
// sequences) still uses the quota; text that a cursor move blows up counts
// as what it became.
func TestQuotaCountsRawBytes(t *testing.T) {
	j := openJournal(t, nil)
	hist, err := OpenHistory(t.TempDir()+"/job.log", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer hist.Close()
	p := j.Pipe(hist, &Quota{PerHour: 1 << 20, Start: time.Now()}, nil)
	esc := bytes.Repeat([]byte("\x1b[0m"), 1<<10)
	for range 300 { // 1.2 MiB of escapes, no text
		_, _ = p.Write(esc)
	}
	select {
	case <-p.QuotaHit():
	default:
		t.Fatal("escape-only output never hit the quota")
	}
	if hist.Size() > 1<<20 {
		t.Fatalf("history kept %d bytes past the quota", hist.Size())
	}
	q := &Quota{PerHour: 1000, Start: time.Now()}
	// raw 10 and stripped 995 fit (the larger, 995, is charged); then raw
	// 1001 or stripped 1001 does not, stripped 1000 does.
	if !q.ChargeRaw(10) || !q.Charge(995) || q.ChargeRaw(991) || q.Charge(6) || !q.Charge(5) {
		t.Fatal("the larger of raw and stripped is what counts")
	}
}

// TestGuardStopsAndResumesLogging: below the floor the pipe keeps nothing
// and says so in both logs, once; above twice the floor it resumes and
// says how much was not kept. The job's writes never fail.
func TestGuardStopsAndResumesLogging(t *testing.T) {
	// Either the filesystem under the logs runs low, or (the runner dir
	// being a filesystem of its own with room to spare) the host's.
	for _, host := range []bool{false, true} {
		t.Run(fmt.Sprint("host=", host), func(t *testing.T) { guardStopsAndResumes(t, host) })
	}
}

func guardStopsAndResumes(t *testing.T, host bool) {
	j := openJournal(t, nil)
	hist, err := OpenHistory(t.TempDir()+"/job.log", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer hist.Close()
	var mu sync.Mutex
	free := int64(100 << 20)
	clock := time.Unix(1000, 0)
	g := &Guard{Path: "/", MinFree: 10 << 20, Now: func() time.Time { return clock },
		Statfs: func(string) (int64, error) { mu.Lock(); defer mu.Unlock(); return free, nil }}
	if host {
		g.Path, g.HostPath, g.HostMinFree = "/own", "/host", 10<<20
		g.Statfs = func(p string) (int64, error) {
			if p == "/own" {
				return 1 << 30, nil
			}
			mu.Lock()
			defer mu.Unlock()
			return free, nil
		}
	}
	p := j.Pipe(hist, nil, g)
	write := func(s string) {
		if n, err := p.Write([]byte(s)); err != nil || n != len(s) {
			t.Fatalf("the job's write failed: %d %v", n, err)
		}
	}
	write("kept-1\r\n")
	mu.Lock()
	free = 5 << 20
	mu.Unlock()
	clock = clock.Add(2 * time.Second)
	write("lost-1\r\n")
	write("lost-2\r\n")
	clock = clock.Add(2 * time.Second)
	mu.Lock()
	free = 15 << 20 // above the floor, under twice it: still stopped
	mu.Unlock()
	write("lost-3\r\n")
	clock = clock.Add(2 * time.Second)
	mu.Lock()
	free = 30 << 20
	mu.Unlock()
	write("kept-2\r\n")
	_ = p.Close()
	raw := readAll(t, hist)
	w, _ := j.Since(0, 1<<20)
	var stripped bytes.Buffer
	for _, e := range w.JobLogs {
		stripped.Write(e.Data)
	}
	for name, got := range map[string]string{"raw": raw, "stripped": stripped.String()} {
		if !strings.Contains(got, "kept-1") || !strings.Contains(got, "kept-2") || strings.Contains(got, "lost-") {
			t.Errorf("%s log: %q", name, got)
		}
		if strings.Count(got, "output is not kept") != 1 || !strings.Contains(got, "output is kept again; 24 bytes of it were not") {
			t.Errorf("%s log lacks the notes: %q", name, got)
		}
	}
}

func readAll(t *testing.T, h *History) string {
	t.Helper()
	var b bytes.Buffer
	rd := h.Reader(time.Time{})
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	for {
		chunk, err := rd.Next(ctx, 1<<20)
		if err != nil {
			return b.String()
		}
		b.Write(chunk)
	}
}

// OnDisk is the bytes of event data the file holds.
func (s *Store) OnDisk() int64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.trim.onDisk(s.size)
}
