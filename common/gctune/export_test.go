package gctune

// Limit is the limit last set.
func (t *Tuner) Limit() int64 { return t.limit.Load() }
