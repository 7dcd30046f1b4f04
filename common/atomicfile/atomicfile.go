// Package atomicfile replaces files so that a reader, or a process started
// after a crash, sees the old content or the new, never a torn mix: a temp
// file in the same directory, fsync, rename.
package atomicfile

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// Options shape one write.
type Options struct {
	Perm os.FileMode // mode of the new file
	// UID and GID own the new file when UID >= 0 (best effort: a failed
	// chown does not fail the write). Leave UID at -1 to keep the caller's.
	UID, GID int
	// SyncDir also fsyncs the directory, making the rename itself survive a
	// power cut (not needed against process crashes).
	SyncDir bool
	// RejectEmpty fails a write of zero bytes before anything is replaced.
	RejectEmpty bool
	// Verify, when set, checks the complete temp file (synced, closed, with
	// its final mode) before it replaces path; an error leaves path as it was.
	Verify func(tmp string) error
}

// TempPattern is the os.CreateTemp pattern of temp files for path; a
// leftover (a write cut short) matches "."+base+".tmp-*".
func TempPattern(path string) string { return "." + filepath.Base(path) + ".tmp-*" }

// Write copies r into path atomically and returns the bytes written.
func Write(path string, r io.Reader, o Options) (int64, error) {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, TempPattern(path))
	if err != nil {
		return 0, fmt.Errorf("write %s: %w", path, err)
	}
	tmp := f.Name()
	n, err := io.Copy(f, r)
	if err == nil && n == 0 && o.RejectEmpty {
		err = errors.New("empty content")
	}
	if err == nil {
		err = f.Chmod(o.Perm)
	}
	if err == nil && o.UID >= 0 {
		_ = f.Chown(o.UID, o.GID)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil && o.Verify != nil {
		err = o.Verify(tmp)
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return n, fmt.Errorf("write %s: %w", path, err)
	}
	if o.SyncDir {
		if d, err := os.Open(dir); err == nil {
			_ = d.Sync()
			d.Close()
		}
	}
	return n, nil
}

// WriteBytes is Write for data in memory.
func WriteBytes(path string, data []byte, o Options) error {
	_, err := Write(path, bytes.NewReader(data), o)
	return err
}
