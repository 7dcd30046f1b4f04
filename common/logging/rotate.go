package logging

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
)

// Log files rotate by size: when a write would take the file past MaxBytes
// it is renamed to <path>.1 (older ones shift to .2 ... .Keep, the oldest
// is dropped) and a new file is started. A shim that runs for months keeps
// at most (Keep+1) × MaxBytes of logs.
const (
	DefaultMaxBytes = 50 << 20
	DefaultKeep     = 3
)

// Rotating is a size-rotated log file, safe for concurrent writes.
type Rotating struct {
	path     string
	maxBytes int64
	keep     int

	mu   sync.Mutex // guards f and size
	f    *os.File
	size int64
}

// OpenRotating opens (appends to) path, creating its directory.
func OpenRotating(path string, maxBytes int64, keep int) (*Rotating, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("log dir: %w", err)
	}
	r := &Rotating{path: path, maxBytes: maxBytes, keep: keep}
	if err := r.open(); err != nil {
		return nil, err
	}
	return r, nil
}

func (r *Rotating) open() error {
	f, err := os.OpenFile(r.path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return fmt.Errorf("log file: %w", err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return fmt.Errorf("log file: %w", err)
	}
	r.f, r.size = f, fi.Size()
	return nil
}

// Write appends p, rotating first when p would pass the size limit.
func (r *Rotating) Write(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.f == nil {
		return 0, os.ErrClosed
	}
	if r.maxBytes > 0 && r.size > 0 && r.size+int64(len(p)) > r.maxBytes {
		if err := r.rotate(); err != nil {
			return 0, err
		}
	}
	n, err := r.f.Write(p)
	r.size += int64(n)
	return n, err
}

func (r *Rotating) rotate() error {
	r.f.Close()
	r.f = nil
	_ = os.Remove(r.path + "." + strconv.Itoa(r.keep))
	for i := r.keep - 1; i >= 1; i-- {
		_ = os.Rename(r.path+"."+strconv.Itoa(i), r.path+"."+strconv.Itoa(i+1))
	}
	if r.keep > 0 {
		_ = os.Rename(r.path, r.path+".1")
	} else {
		_ = os.Remove(r.path)
	}
	return r.open()
}

// Close closes the file.
func (r *Rotating) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.f == nil {
		return nil
	}
	err := r.f.Close()
	r.f = nil
	return err
}
