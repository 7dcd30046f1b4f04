package logs

import "time"

// OpenHistory creates (appends to) the raw log at path, keeping all of it.
func OpenHistory(path string, now func() time.Time) (*History, error) {
	return OpenHistoryRetained(path, now, Retention{})
}

// Append stores data under ts; ts must not go backwards.
func (s *Store) Append(ts int64, data []byte) error { return s.AppendKeeping(ts, data, keepAll) }
