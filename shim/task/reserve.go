package task

// The state reserve: disk space held back for the shim's own records.

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// reserve is a file of real (allocated, not sparse) blocks beside the task
// records. Jobs write into the same filesystem (their logs, their runner
// dirs); when it fills anyway, the shim gives the reserve back to the
// filesystem and writes its record in the space it frees, so a job can
// fill the disk but never make the shim lose a task's state. The reserve
// is taken again once the filesystem has room for it several times over.
type reserve struct {
	path string
	size int64
	log  *slog.Logger

	mu   sync.Mutex
	held bool
}

// defaultReserve holds a few thousand task records.
const defaultReserve = 8 << 20

// take allocates the reserve when it is not held and the filesystem has
// room for it (four times its size free), so that taking it never starves
// what is running. Idempotent.
func (r *reserve) take() {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.held {
		return
	}
	if fi, err := os.Stat(r.path); err == nil && fi.Size() >= r.size {
		r.held = true // a previous run's
		return
	}
	var st unix.Statfs_t
	if err := unix.Statfs(filepath.Dir(r.path), &st); err != nil || int64(st.Bavail)*int64(st.Bsize) < 4*r.size {
		return
	}
	f, err := os.OpenFile(r.path, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return
	}
	err = unix.Fallocate(int(f.Fd()), 0, 0, r.size)
	if errors.Is(err, unix.EOPNOTSUPP) { // no fallocate: write the blocks
		err = writeZeros(f, r.size)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = os.Remove(r.path)
		r.log.Warn("could not take the state reserve", "path", r.path, "err", err)
		return
	}
	r.held = true
}

// release gives the reserve back to the filesystem; false when none was
// held (a write that failed for lack of space cannot be helped then).
func (r *reserve) release() bool {
	if r == nil {
		return false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.held {
		return false
	}
	r.held = false
	if err := os.Remove(r.path); err != nil && !os.IsNotExist(err) {
		r.log.Error("could not release the state reserve", "path", r.path, "err", err)
		return false
	}
	r.log.Error("the shim home's filesystem is full: released the state reserve to save task records; free space there", "path", r.path, "bytes", r.size)
	return true
}

// noSpace says whether err is the filesystem (or a quota) being full.
func noSpace(err error) bool {
	return errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT)
}

func writeZeros(f *os.File, n int64) error {
	buf := make([]byte, 64<<10)
	for n > 0 {
		k := min(n, int64(len(buf)))
		if _, err := f.Write(buf[:k]); err != nil {
			return fmt.Errorf("fill reserve: %w", err)
		}
		n -= k
	}
	return nil
}
