package logs

import (
	"errors"
	"fmt"
	"os"
	"sort"
	"sync"
)

// Event is one stored event.
type Event struct {
	Timestamp int64
	Data      []byte
}

// entry is one event's place in the file. The one entry with n < 0 is the
// marker standing where the middle of the log was dropped (off: the hole's
// start); its text is made when read.
type entry struct {
	ts  int64
	off int64
	n   int32
}

const markerEntry = -1

// Store is an append-only list of timestamped byte events kept in a file;
// only a 20-byte index entry per event stays in memory.
type Store struct {
	mu    sync.RWMutex // guards the fields below
	f     *os.File
	index []entry
	size  int64
	trim  trim
	// holeAt is where the dropped middle starts (-1: nothing dropped);
	// dropped counts its bytes.
	holeAt, dropped int64
}

// OpenStore creates (truncates) the store's file at path, keeping every
// event.
func OpenStore(path string) (*Store, error) { return OpenStoreRetained(path, Retention{}) }

// OpenStoreRetained creates (truncates) the store's file at path; r bounds
// what stays on disk: the first events (Head bytes) and the newest, whole
// events only. Dropped events leave the index too.
func OpenStoreRetained(path string, r Retention) (*Store, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR|os.O_TRUNC, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open log store: %w", err)
	}
	return &Store{f: f, trim: newTrim(r), holeAt: -1}, nil
}

// AppendKeeping stores data under ts (ts must not go backwards); the
// log's bound drops no event after keepAfter (a reader has not had them yet; the file grows past its bound
// meanwhile); keepAll holds nothing back.
func (s *Store) AppendKeeping(ts int64, data []byte, keepAfter int64) error {
	if len(data) == 0 {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if n := len(s.index); n > 0 && ts < s.index[n-1].ts {
		return errors.New("log store: timestamp went backwards")
	}
	if s.trim.full(s.size) {
		return nil // no hole punching here: past Max nothing more is kept
	}
	if _, err := s.f.WriteAt(data, s.size); err != nil {
		return fmt.Errorf("log store: %w", err)
	}
	s.index = append(s.index, entry{ts: ts, off: s.size, n: int32(len(data))})
	s.size += int64(len(data))
	return s.trimLocked(keepAfter)
}

// trimLocked drops whole events from the middle once the file holds more
// than its retention.
func (s *Store) trimLocked(keepAfter int64) error {
	want := s.trim.plan(s.size)
	if want <= s.trim.dropEnd {
		return nil
	}
	// Events that start inside the head stay whole: the hole starts at
	// the first event at or after it, and ends where an event starts.
	lo := sort.Search(len(s.index), func(i int) bool { return s.index[i].off >= s.trim.dropEnd })
	hi := sort.Search(len(s.index), func(i int) bool { return s.index[i].off >= want })
	if hi >= len(s.index) {
		hi = len(s.index) - 1 // the newest event always stays
	}
	if keepAfter != keepAll {
		hi = min(hi, sort.Search(len(s.index), func(i int) bool { return s.index[i].ts > keepAfter }))
	}
	if hi <= lo {
		return nil
	}
	// An event straddling the head's end keeps its bytes past it.
	from, to := s.index[lo].off, s.index[hi].off
	if err := s.trim.punch(s.f, from, to); err != nil {
		return err
	}
	if s.trim.capped {
		return nil
	}
	// The dropped events leave the index; the marker stands in their place
	// (one marker: each hole starts where the last one ended), stamped as
	// the last of them so a reader past it does not see it again.
	s.dropped += to - from
	last := s.index[hi-1].ts
	if s.holeAt < 0 {
		s.holeAt = from
		s.index[lo] = entry{ts: last, off: from, n: markerEntry}
		lo++
	} else {
		s.index[lo-1].ts = last
	}
	s.index = append(s.index[:lo], s.index[hi:]...)
	return nil
}

// marker is the text that stands where the middle of the log was dropped.
func (s *Store) marker() []byte {
	return fmt.Appendf(nil, "[tandem: %d bytes of output were dropped here to bound the job's log on disk: it keeps the first %d and the latest %d bytes]\n",
		s.dropped, s.trim.r.Head, s.trim.r.Max-s.trim.r.Head)
}

// size of an entry's data.
func (s *Store) sizeOf(e entry) int {
	if e.n == markerEntry {
		return len(s.marker())
	}
	return int(e.n)
}

// Behind says how far appending n bytes would go past what the log keeps
// beside the events a reader has not had (those after acked): > 0, the
// bound would drop some of them. Never > 0 for an unbounded log, or one
// that cannot drop its middle (past its bound it keeps nothing more).
func (s *Store) Behind(acked int64, n int) int64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.trim.r.Max <= 0 || s.trim.capped {
		return 0
	}
	i := sort.Search(len(s.index), func(i int) bool { return s.index[i].ts > acked })
	unread := int64(0)
	if i < len(s.index) {
		off := s.index[i].off
		unread = s.size - off
		if s.holeAt >= 0 && off <= s.holeAt {
			unread -= s.trim.dropEnd - s.holeAt
		}
	}
	return unread + int64(n) - (s.trim.r.Max - s.trim.r.Head)
}

// After returns events with timestamp > after and ≤ upTo, at most maxBytes of
// data (always at least one event if any match). more reports whether
// matching events were left out.
func (s *Store) After(after, upTo int64, maxBytes int) (evs []Event, more bool, err error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	i := sort.Search(len(s.index), func(i int) bool { return s.index[i].ts > after })
	j, total := i, 0
	for ; j < len(s.index) && s.index[j].ts <= upTo; j++ {
		n := s.sizeOf(s.index[j])
		if total > 0 && total+n > maxBytes {
			more = true
			break
		}
		total += n
	}
	if j == i {
		return nil, more, nil
	}
	// Events written one after another lie one after another in the file:
	// each such run is one read into one buffer that the events share (a
	// read per event was most of a pull's system time).
	buf := make([]byte, 0, total)
	evs = make([]Event, 0, j-i)
	for k := i; k < j; {
		e := s.index[k]
		if e.n == markerEntry {
			m := s.marker()
			start := len(buf)
			buf = append(buf, m...)
			evs = append(evs, Event{Timestamp: e.ts, Data: buf[start:len(buf):len(buf)]})
			k++
			continue
		}
		end, size := k+1, int64(e.n)
		for ; end < j && s.index[end].n != markerEntry && s.index[end].off == e.off+size; end++ {
			size += int64(s.index[end].n)
		}
		start := len(buf)
		buf = buf[:start+int(size)]
		if _, err := s.f.ReadAt(buf[start:], e.off); err != nil {
			return nil, false, fmt.Errorf("log store: %w", err)
		}
		for ; k < end; k++ {
			n := int(s.index[k].n)
			evs = append(evs, Event{Timestamp: s.index[k].ts, Data: buf[start : start+n : start+n]})
			start += n
		}
	}
	return evs, more, nil
}

// Sizes returns the (timestamp, size) pairs after ts up to upTo, without data.
func (s *Store) Sizes(after, upTo int64) (ts []int64, n []int) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	i := sort.Search(len(s.index), func(i int) bool { return s.index[i].ts > after })
	for ; i < len(s.index) && s.index[i].ts <= upTo; i++ {
		ts = append(ts, s.index[i].ts)
		n = append(n, s.sizeOf(s.index[i]))
	}
	return ts, n
}

// Len returns the number of events.
func (s *Store) Len() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return len(s.index)
}

// Newest is the timestamp of the newest event (0: none yet).
func (s *Store) Newest() int64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if len(s.index) == 0 {
		return 0
	}
	return s.index[len(s.index)-1].ts
}

// Close closes the file.
func (s *Store) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.f.Close()
}

// PullWindow decides how far one /api/pull answer goes: from after up to
// last, stopping early (capped) where the events of all stores, merged by
// timestamp, would pass byteCap bytes; at least one event is always
// included so a huge one cannot stall the stream. The caller holds the
// clock's lock so no event at or before last is still being appended.
func PullWindow(after, last int64, byteCap int, stores ...*Store) (upTo int64, capped bool) {
	type ev struct {
		ts int64
		n  int
	}
	var all []ev
	for _, s := range stores {
		ts, n := s.Sizes(after, last)
		for i := range ts {
			all = append(all, ev{ts[i], n[i]})
		}
	}
	sort.SliceStable(all, func(i, j int) bool { return all[i].ts < all[j].ts })
	total := 0
	for _, e := range all {
		if total > 0 && total+e.n > byteCap {
			return e.ts - 1, true
		}
		total += e.n
	}
	return last, false
}
