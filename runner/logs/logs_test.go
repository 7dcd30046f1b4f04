package logs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

func strip(t *testing.T, chunks ...string) []string {
	t.Helper()
	var out []string
	s := NewStripper(func(b []byte) { out = append(out, string(b)) })
	s.IdleFlush, s.ForceFlush = time.Hour, time.Hour
	for _, c := range chunks {
		_, _ = s.Write([]byte(c))
	}
	s.Close()
	return out
}

func TestStripper(t *testing.T) {
	tests := []struct {
		name   string
		chunks []string
		want   string
	}{
		{"plain lines with crlf", []string{"hello\r\nworld\r\n"}, "hello\nworld\n"},
		{"colours dropped", []string{"\x1b[1;31mred\x1b[0m text\r\n"}, "red text\n"},
		{"progress bar collapses", []string{"  0%\r 50%\r100%\r\ndone\r\n"}, "100%\ndone\n"},
		{"erase line", []string{"downloading 10 MB\r\x1b[Kok\r\n"}, "ok\n"},
		{"backspace", []string{"abc\b\bX\r\n"}, "aXc\n"},
		{"cursor up redraw", []string{"a: 1\r\nb: 1\r\n\x1b[2Aa: 2\r\nb: 2\r\n"}, "a: 2\nb: 2\n"},
		{"split escape across writes", []string{"x\x1b[3", "1my\r\n"}, "xy\n"},
		{"split utf-8 across writes", []string{"caf\xc3", "\xa9\r\n"}, "café\n"},
		{"invalid utf-8 dropped", []string{"a\xffb\r\n"}, "ab\n"},
		{"osc title dropped", []string{"\x1b]0;title\x07text\r\n"}, "text\n"},
		{"unfinished last line on close", []string{"no newline"}, "no newline\n"},
		{"trailing spaces trimmed", []string{"pad   \r\n"}, "pad\n"},
		{"cursor column", []string{"abcdef\x1b[3GX\r\n"}, "abXdef\n"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := strings.Join(strip(t, tc.chunks...), "")
			if got != tc.want {
				t.Fatalf("got %q want %q", got, tc.want)
			}
		})
	}
}

func TestStripperFlushTriggers(t *testing.T) {
	var mu sync.Mutex
	var out []string
	s := NewStripper(func(b []byte) { mu.Lock(); out = append(out, string(b)); mu.Unlock() })
	s.IdleFlush = 20 * time.Millisecond
	_, _ = s.Write([]byte("first\r\nhalf"))
	time.Sleep(80 * time.Millisecond)
	mu.Lock()
	if len(out) != 1 || out[0] != "first\n" {
		t.Fatalf("idle flush emits completed lines only: %q", out)
	}
	mu.Unlock()
	s.MaxBuffer = 10
	_, _ = s.Write([]byte(" line\r\n" + strings.Repeat("x", 20) + "\r\n"))
	mu.Lock()
	if strings.Join(out[1:], "") != "half line\n"+strings.Repeat("x", 20)+"\n" {
		t.Fatalf("buffer limit flushes at once: %q", out)
	}
	mu.Unlock()
	s.Close()
}

func TestClockStrictlyIncreasingUnderBurst(t *testing.T) {
	now := time.Unix(100, 0)
	c := NewClock(func() time.Time { return now })
	prev := int64(0)
	for i := 0; i < 5000; i++ { // 5000 events in one wall-clock millisecond
		ts := c.Next()
		if ts <= prev {
			t.Fatalf("event %d: %d after %d", i, ts, prev)
		}
		prev = ts
	}
	now = now.Add(time.Hour)
	if ts := c.Next(); ts != now.UnixMilli() {
		t.Fatalf("clock must return to wall time: %d", ts)
	}
}

func TestStoreAfterAndCap(t *testing.T) {
	s, err := OpenStore(filepath.Join(t.TempDir(), "s"))
	if err != nil {
		t.Fatal(err)
	}
	for i := 1; i <= 10; i++ {
		if err := s.Append(int64(i), []byte(fmt.Sprintf("event-%02d", i))); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Append(5, []byte("x")); err == nil {
		t.Fatal("timestamps must not go backwards")
	}
	evs, more, err := s.After(3, 100, 1<<20)
	if err != nil || more || len(evs) != 7 || string(evs[0].Data) != "event-04" {
		t.Fatalf("after 3: %d %v %v", len(evs), more, err)
	}
	// The events share one read: each holds its own bytes, and growing one
	// never writes into the next.
	evs[0].Data = append(evs[0].Data, '!')
	for k, e := range evs {
		want := fmt.Sprintf("event-%02d", k+4)
		if k == 0 {
			want += "!"
		}
		if string(e.Data) != want || e.Timestamp != int64(k+4) {
			t.Fatalf("event %d: %d %q, want %q", k, e.Timestamp, e.Data, want)
		}
	}
	evs, more, _ = s.After(0, 100, 20)
	if !more || len(evs) != 2 {
		t.Fatalf("cap: %d %v", len(evs), more)
	}
	evs, _, _ = s.After(0, 100, 1)
	if len(evs) != 1 {
		t.Fatal("at least one event even over the cap")
	}
	evs, _, _ = s.After(0, 4, 1<<20)
	if len(evs) != 4 {
		t.Fatalf("upTo bound: %d", len(evs))
	}
}

func TestHistoryFollowAndSince(t *testing.T) {
	now := time.Unix(1000, 0)
	var mu sync.Mutex
	h, err := OpenHistory(filepath.Join(t.TempDir(), "job.log"), func() time.Time { mu.Lock(); defer mu.Unlock(); return now })
	if err != nil {
		t.Fatal(err)
	}
	_, _ = h.Write([]byte("old\r\n"))
	mu.Lock()
	now = now.Add(5 * time.Second)
	mu.Unlock()
	_, _ = h.Write([]byte("new\r\n"))
	r := h.Reader(time.Unix(1003, 0))
	b, err := r.Next(context.Background(), 1024)
	if err != nil || string(b) != "new\r\n" {
		t.Fatalf("since: %q %v", b, err)
	}
	done := make(chan string)
	go func() {
		b, _ := r.Next(context.Background(), 1024)
		done <- string(b)
	}()
	time.Sleep(20 * time.Millisecond)
	_, _ = h.Write([]byte("live"))
	if got := <-done; got != "live" {
		t.Fatalf("follow: %q", got)
	}
	h.Close()
	if _, err := r.Next(context.Background(), 1024); !errors.Is(err, io.EOF) {
		t.Fatalf("end: %v", err)
	}
	all := h.Reader(time.Time{})
	b, _ = all.Next(context.Background(), 1<<20)
	if string(b) != "old\r\nnew\r\nlive" {
		t.Fatalf("full history: %q", b)
	}
}

// screenRunes is what the stripper really holds: runes, line headers
// counted as one each (the unit of its budget), recomputed from scratch.
func screenRunes(s *Stripper) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := len(s.lines) + cap(s.out)/4 // settled text: bytes, a quarter of a rune's room
	for _, l := range s.lines {
		n += cap(l)
	}
	return n
}

// FuzzStripperPlainLinesMatchTheScreen: plain lines skip the screen, yet
// what comes out is what the screen alone makes of the same bytes, in the
// same writes, whatever cursor moves, clears and redraws come between
// (the budget is out of reach, so both flush only at Close).
func FuzzStripperPlainLinesMatchTheScreen(f *testing.F) {
	f.Add([]byte("a: 1\r\nb: 1\r\n\x1b[2Aa: 2\r\nb: 2\r\n"), uint8(7))
	f.Add([]byte("log line\r\n 10%|#    |\r\n\x1b[A\r 20%|##   |\r\nnext\r\n\x1b[5A\x1b[2Kx\n"), uint8(3))
	f.Add([]byte("one\r\ntwo\r\n\x1b[Hthree\r\n\x1b[2Jfour\nfive  \r\n"), uint8(64))
	f.Add([]byte("caf\xc3\xa9\r\nabc\r\n\x1b[2Ax\r\n\x1b[3;2Hy\n\t\r\n"), uint8(1))
	f.Fuzz(func(t *testing.T, b []byte, split uint8) {
		run := func(screenOnly bool) string {
			var out strings.Builder
			s := NewStripper(func(p []byte) { out.Write(p) })
			s.IdleFlush, s.ForceFlush, s.MaxBuffer = time.Hour, time.Hour, 1<<30
			s.screenOnly = screenOnly
			step := int(split%64) + 1
			for i := 0; i < len(b); i += step {
				_, _ = s.Write(b[i:min(i+step, len(b))])
			}
			s.Close()
			return out.String()
		}
		if got, want := run(false), run(true); got != want {
			t.Fatalf("plain lines gave %q, the screen %q", got, want)
		}
	})
}

// FuzzStripper asserts the memory bound, not only "no panic": whatever the
// input, the buffered screen stays within MaxBuffer plus one step, and the
// output never grows by more than a terminal's width or height per input byte.
func FuzzStripper(f *testing.F) {
	f.Add([]byte("a\x1b[2A\x1b[10B\x1b[999Cb\r\n\x1b[2J\x1b]0;t\x07\xc3"))
	f.Add([]byte("0000000000000000000000000\x1b[B\x1b[9000000099C0"))
	f.Add([]byte("\x1b[2000000000Cx\x1b[65535;65535Hy\x1b[9999999999999999999999B"))
	f.Fuzz(func(t *testing.T, b []byte) {
		var n int
		s := NewStripper(func(p []byte) { n += len(p) })
		s.IdleFlush, s.ForceFlush = time.Hour, time.Hour
		// Two writes of the same bytes: the second starts from whatever
		// state the first left (cursor far right, many rows, ...).
		for range 2 {
			_, _ = s.Write(b)
			// Slices may hold up to twice their length (append growth).
			if got, limit := screenRunes(s), 2*(s.MaxBuffer+2*MaxColumns+len(b))+64; got > limit {
				t.Fatalf("stripper holds %d runes after %d input bytes (limit %d)", got, len(b), limit)
			}
		}
		s.Close()
		if limit := 2 * (len(b) + 1) * (MaxColumns + MaxRowMove + 8); n > limit {
			t.Fatalf("%d output bytes from %d input bytes", n, 2*len(b))
		}
	})
}

func TestStripperEscapeBombs(t *testing.T) {
	tests := []struct {
		name, in, want string
	}{
		// dstack-runner's stripper padded this line with 2e9 spaces.
		{"huge column move is garbage", "\x1b[2000000000Cx\r\nnext\r\n", "x\nnext\n"},
		{"column move within a terminal's width", "\x1b[5Cx\r\n", "     x\n"},
		{"column clamp at MaxColumns", "\x1b[9999Cx\r\n", strings.Repeat(" ", MaxColumns-1) + "x\n"},
		{"huge row move is ignored", "a\x1b[9000000099Bb\r\n", "ab\n"},
		{"row move clamped", "a\x1b[1000Bb\r\n", "a\n" + strings.Repeat("\n", MaxRowMove-1) + " b\n"},
		{"absolute position clamped", "\x1b[1;60000Hx\r\n", strings.Repeat(" ", MaxColumns-1) + "x\n"},
		{"overflowing number is garbage", "\x1b[99999999999999999999999999Cx\r\n", "x\n"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := strings.Join(strip(t, tc.in), "")
			if got != tc.want {
				t.Fatalf("got %d bytes %.80q, want %d bytes %.80q", len(got), got, len(tc.want), tc.want)
			}
		})
	}
}

// TestStripperManyRowMovesBounded: one 64 KiB write of cursor-down moves
// would append 2.8M lines if the budget were checked only per write.
func TestStripperManyRowMovesBounded(t *testing.T) {
	var total int
	s := NewStripper(func(b []byte) { total += len(b) })
	s.IdleFlush, s.ForceFlush = time.Hour, time.Hour
	bomb := []byte(strings.Repeat("\x1b[256B", 64<<10/6))
	_, _ = s.Write(bomb)
	if got := screenRunes(s); got > 2*(s.MaxBuffer+MaxRowMove)+64 {
		t.Fatalf("stripper holds %d runes", got)
	}
	s.Close()
	if total == 0 {
		t.Fatal("nothing emitted")
	}
}

func TestStripperHugeLineStaysBounded(t *testing.T) {
	var total, biggest int
	s := NewStripper(func(b []byte) {
		total += len(b)
		biggest = max(biggest, len(b))
	})
	s.IdleFlush, s.ForceFlush = time.Hour, time.Hour
	chunk := []byte(strings.Repeat("x", 4096))
	for i := 0; i < 256; i++ { // 1 MiB, no newline
		_, _ = s.Write(chunk)
	}
	s.mu.Lock()
	buffered := s.size
	s.mu.Unlock()
	if buffered > s.MaxBuffer+len(chunk) {
		t.Fatalf("stripper buffers %d bytes of one endless line", buffered)
	}
	s.Close()
	// Every byte arrives, split into bounded pieces each ending in a newline.
	if total < 256*4096 || biggest > s.MaxBuffer+len(chunk)+1 {
		t.Fatalf("total %d biggest %d", total, biggest)
	}
}

func TestPullWindowMergesStoresUnderTheCap(t *testing.T) {
	dir := t.TempDir()
	a, _ := OpenStore(filepath.Join(dir, "a"))
	b, _ := OpenStore(filepath.Join(dir, "b"))
	defer a.Close()
	defer b.Close()
	// a: ts 1,3,5 (40 bytes each); b: ts 2,4 (30 bytes each).
	for _, ts := range []int64{1, 3, 5} {
		_ = a.Append(ts, make([]byte, 40))
	}
	for _, ts := range []int64{2, 4} {
		_ = b.Append(ts, make([]byte, 30))
	}
	tests := []struct {
		after, last int64
		cap         int
		upTo        int64
		capped      bool
	}{
		{0, 5, 1000, 5, false},
		{0, 5, 100, 2, true},  // 40+30=70; +40 > 100: stop before ts 3
		{0, 5, 10, 1, true},   // the first event alone is over the cap: it still goes
		{2, 5, 75, 4, true},   // 40+30=70 fit, +40 does not
		{4, 5, 1, 5, false},   // a single event always goes
		{5, 5, 100, 5, false}, // nothing new
	}
	for _, tc := range tests {
		upTo, capped := PullWindow(tc.after, tc.last, tc.cap, a, b)
		if upTo != tc.upTo || capped != tc.capped {
			t.Errorf("%+v: upTo %d capped %v", tc, upTo, capped)
		}
	}
}

// The write-behind tail: readers see every byte as written, whether it is
// still in memory, already in the file, or split across both; the file
// holds everything once closed; writes bigger than the tail keep their
// place in the order.
func TestHistoryTailAndFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "job.log")
	h, err := OpenHistory(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	var want []byte
	r := h.Reader(time.Time{})
	var got []byte
	for i := 0; len(want) < 5*historyTail; i++ {
		size := 1 + (i*977)%(32<<10)
		if i%7 == 3 { // bigger than the tail: straight to the file, after it
			size = historyTail + 1000
		}
		chunk := bytes.Repeat([]byte{byte('a' + i%26)}, size)
		if _, err := h.Write(chunk); err != nil {
			t.Fatal(err)
		}
		want = append(want, chunk...)
		if i%3 == 0 { // read part of the way, odd sizes, mid-tail and mid-file
			b, err := r.Next(context.Background(), 5000+i)
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, b...)
		}
	}
	if fi, _ := os.Stat(path); fi.Size() >= int64(len(want)) || fi.Size() == 0 {
		t.Fatalf("the file has %d of %d bytes: some should still be in the tail, some flushed", fi.Size(), len(want))
	}
	if h.Size() != int64(len(want)) {
		t.Fatalf("size %d, want %d", h.Size(), len(want))
	}
	if err := h.Close(); err != nil {
		t.Fatal(err)
	}
	for {
		b, err := r.Next(context.Background(), 7777)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, b...)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("reader got %d bytes, want %d (equal: %v)", len(got), len(want), bytes.Equal(got, want))
	}
	if onDisk, _ := os.ReadFile(path); !bytes.Equal(onDisk, want) {
		t.Fatalf("file has %d bytes, want %d", len(onDisk), len(want))
	}
}

// The eight-at-a-time helpers agree with the plain loops on every byte
// value at every position of a block, and across block boundaries.
func TestStripperWordHelpers(t *testing.T) {
	naiveRun := func(p []byte) int {
		i := 0
		for i < len(p) && p[i] >= 0x20 && p[i] < 0x7f {
			i++
		}
		return i
	}
	for n := 0; n <= 19; n++ {
		for pos := 0; pos < n; pos++ {
			for b := 0; b < 256; b++ {
				p := bytes.Repeat([]byte{'a'}, n)
				p[pos] = byte(b)
				if got, want := printableRun(p), naiveRun(p); got != want {
					t.Fatalf("printableRun(%q) = %d, want %d", p, got, want)
				}
				if run := naiveRun(p); run > 0 {
					r := make([]rune, run)
					widen(r, p[:run])
					back := make([]byte, run)
					if k := narrow(back, r); k != run || !bytes.Equal(back, p[:run]) {
						t.Fatalf("widen/narrow round trip of %q: %q (%d)", p[:run], back, k)
					}
				}
			}
		}
	}
	// narrow stops at the first non-ASCII rune, wherever it is.
	for pos := 0; pos < 19; pos++ {
		r := []rune(strings.Repeat("x", 19))
		r[pos] = 'é'
		if k := narrow(make([]byte, 19), r); k != pos {
			t.Fatalf("narrow stopped at %d, want %d", k, pos)
		}
	}
}

// readToEnd reads r to io.EOF in chunks of max.
func readToEnd(t *testing.T, r *HistoryReader, max int) []byte {
	t.Helper()
	var got []byte
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for {
		b, err := r.Next(ctx, max)
		if errors.Is(err, io.EOF) {
			return got
		}
		if err != nil {
			t.Fatalf("after %d bytes: %v", len(got), err)
		}
		got = append(got, b...)
	}
}

// A so-far reader ends where the output written when it was made ends,
// from since on, in the tail or in the file, while the job writes on; a
// following reader made at the same time gets the rest too.
func TestHistoryReaderSoFar(t *testing.T) {
	now := time.Unix(1000, 0)
	var mu sync.Mutex
	h, err := OpenHistory(filepath.Join(t.TempDir(), "job.log"), func() time.Time { mu.Lock(); defer mu.Unlock(); return now })
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	old := bytes.Repeat([]byte("o"), historyTail+100) // past the tail: some in the file
	_, _ = h.Write(old)
	mu.Lock()
	now = now.Add(5 * time.Second)
	mu.Unlock()
	_, _ = h.Write([]byte("new\r\n"))
	all, recent, follow := h.ReaderSoFar(time.Time{}), h.ReaderSoFar(time.Unix(1003, 0)), h.Reader(time.Unix(1003, 0))
	_, _ = h.Write([]byte("later\r\n"))
	if got := readToEnd(t, all, 999); !bytes.Equal(got, append(append([]byte{}, old...), "new\r\n"...)) {
		t.Fatalf("so far from the start: %d bytes, ending %q", len(got), got[max(0, len(got)-10):])
	}
	if got := readToEnd(t, recent, 2); string(got) != "new\r\n" {
		t.Fatalf("so far since: %q", got)
	}
	b, err := follow.Next(context.Background(), 1024)
	if err != nil || string(b) != "new\r\nlater\r\n" {
		t.Fatalf("follow: %q %v", b, err)
	}
	if got := readToEnd(t, h.ReaderSoFar(time.Unix(2000, 0)), 1024); len(got) != 0 {
		t.Fatalf("so far since after the last output: %q", got)
	}
}

// A so-far reader of a history that dropped its middle gets the head, the
// marker, and the kept output up to where the output stood, no further.
func TestHistoryReaderSoFarAcrossAHole(t *testing.T) {
	path := t.TempDir() + "/job.log"
	h, err := OpenHistoryRetained(path, nil, Retention{Head: 1 << 20, Max: 4 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	var all bytes.Buffer
	for i := 0; all.Len() < 16<<20; i++ {
		all.WriteString(line(i))
		_, _ = h.Write([]byte(line(i)))
	}
	r := h.ReaderSoFar(time.Time{})
	_, _ = h.Write([]byte("after\n"))
	got := readToEnd(t, r, 1<<20)
	want := all.Bytes()
	if !bytes.HasPrefix(got, want[:1<<20]) || !bytes.Contains(got, []byte("bytes of output were dropped")) {
		t.Fatal("no head and marker")
	}
	if !bytes.HasSuffix(got, want[len(want)-1000:]) || bytes.Contains(got, []byte("after")) {
		t.Fatalf("does not end where the output stood: %q", got[len(got)-40:])
	}
}

// Flush puts the tail in the file at once (a stop's first step: the
// container may be killed before the tail's timer).
func TestHistoryFlush(t *testing.T) {
	path := filepath.Join(t.TempDir(), "job.log")
	h, err := OpenHistory(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = h.Write([]byte("before the stop\r\n"))
	if b, _ := os.ReadFile(path); len(b) != 0 {
		t.Fatalf("the tail is in the file before Flush: %q", b)
	}
	if err := h.Flush(); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(path); string(b) != "before the stop\r\n" {
		t.Fatalf("after Flush the file holds %q", b)
	}
	_, _ = h.Write([]byte("more"))
	if err := h.Close(); err != nil {
		t.Fatal(err)
	}
	if err := h.Flush(); err != nil {
		t.Fatalf("Flush after Close: %v", err)
	}
	if b, _ := os.ReadFile(path); string(b) != "before the stop\r\nmore" {
		t.Fatalf("at the end the file holds %q", b)
	}
}
