package logs

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Retention bounds one append-only log file on disk: its first Head bytes
// and its newest bytes stay, Max in all; the middle is given back to the
// filesystem by punching a hole in the file (FALLOC_FL_PUNCH_HOLE), so the
// file's offsets, and every reader's position, stay what they were. What
// users need most of a long job's output is how it started and how it is
// going. Max ≤ 0 keeps everything.
type Retention struct {
	Head, Max int64
}

// Default retention of each of a job's two log files (raw terminal output,
// stripped lines), so a job's logs take at most 64 MiB of the shim home:
// small root disks hold several jobs' worth.
const (
	DefaultLogMax  = 32 << 20
	DefaultLogHead = 4 << 20
)

// punchStep is the least a hole grows by: one fallocate per MiB of output.
const punchStep = 1 << 20

// trim is a file's retention state.
type trim struct {
	r Retention
	// dropped is [r.Head, dropEnd): bytes given back (none: dropEnd ≤ Head).
	dropEnd int64
	// capped: the filesystem cannot punch holes; output past Max is not
	// written at all (the head stays).
	capped bool
}

func newTrim(r Retention) trim {
	if r.Max > 0 {
		r.Head = min(max(r.Head, 0), r.Max/2)
	}
	return trim{r: r, dropEnd: r.Head}
}

// onDisk is how many bytes of a file of logical size the disk holds
// (dropEnd starts at Head and only grows).
func (t *trim) onDisk(size int64) int64 { return size - (t.dropEnd - t.r.Head) }

// plan returns the end of the hole to punch for a file of logical size
// (≤ dropEnd: nothing to do yet). The hole starts at dropEnd.
func (t *trim) plan(size int64) int64 {
	if t.r.Max <= 0 || t.capped {
		return t.dropEnd
	}
	over := t.onDisk(size) - t.r.Max
	if over < punchStep {
		return t.dropEnd
	}
	return t.dropEnd + over
}

// punch gives [from, to) of f back to the filesystem. A filesystem without
// hole punching makes the trim capped.
func (t *trim) punch(f *os.File, from, to int64) error {
	if to <= from {
		return nil
	}
	err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, from, to-from)
	if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOSYS) {
		t.capped = true
		return nil
	}
	if err != nil {
		return fmt.Errorf("trim log: %w", err)
	}
	t.dropEnd = to
	return nil
}

// full says whether a capped file takes no more bytes.
func (t *trim) full(size int64) bool {
	return t.capped && t.r.Max > 0 && size >= t.r.Max
}

// Guard stops writing logs when the filesystem under them runs low: below
// MinFree bytes free, Allow says no (the job goes on; its output is not
// kept) until twice that is free again. It asks the filesystem at most
// every checkBytes written or checkEvery.
type Guard struct {
	Path    string // a path on the filesystem to watch
	MinFree int64  // ≤ 0: none
	// HostPath, when set, is a path on a second filesystem to watch with
	// its own floor, HostMinFree: the host's, under a runner dir that is a
	// filesystem of its own (a sparse image there fails its writes when
	// the host's disk is full, however much room it says it has).
	HostPath    string
	HostMinFree int64
	// Statfs returns the bytes free to unprivileged writers at path
	// (injected in tests; StatfsFree by default).
	Statfs func(path string) (int64, error)
	Now    func() time.Time
	// Log hears when output stops and starts being kept (nil: the
	// journal's logger).
	Log *slog.Logger

	mu      sync.Mutex
	since   int64 // bytes allowed since the last look
	lastAt  time.Time
	free    int64 // of the filesystem nearest its floor
	floor   int64 // that filesystem's
	stopped bool
}

const (
	checkBytes = 1 << 20
	checkEvery = time.Second
)

// StatfsFree is the free bytes of path's filesystem for unprivileged
// writers (what a root job also leaves alone: the root reserve is not
// counted).
func StatfsFree(path string) (int64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return 0, err
	}
	return int64(st.Bavail) * int64(st.Bsize), nil
}

// DefaultMinFree is the floor for a filesystem of size bytes: a tenth of
// it, at most 256 MiB.
func DefaultMinFree(size int64) int64 { return min(size/10, 256<<20) }

// FSSize is the size of path's filesystem.
func FSSize(path string) (int64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return 0, err
	}
	return int64(st.Blocks) * int64(st.Bsize), nil
}

// Allow accounts n bytes about to be written and says whether they may
// be; changed reports a switch between stopped and writing.
func (g *Guard) Allow(n int) (ok, changed bool) {
	if g == nil || (g.MinFree <= 0 && (g.HostPath == "" || g.HostMinFree <= 0)) {
		return true, false
	}
	now := time.Now
	if g.Now != nil {
		now = g.Now
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	t := now()
	if g.lastAt.IsZero() || g.since+int64(n) >= checkBytes || t.Sub(g.lastAt) >= checkEvery {
		statfs := g.Statfs
		if statfs == nil {
			statfs = StatfsFree
		}
		// Each filesystem against its floor: the one nearest it decides.
		low, resume := false, true
		first := true
		for _, w := range [...]struct {
			path  string
			floor int64
		}{{g.Path, g.MinFree}, {g.HostPath, g.HostMinFree}} {
			if w.path == "" || w.floor <= 0 {
				continue
			}
			free, err := statfs(w.path)
			if err != nil {
				continue
			}
			if first || free-w.floor < g.free-g.floor {
				g.free, g.floor = free, w.floor
			}
			first = false
			low = low || free-int64(n) < w.floor
			resume = resume && free >= 2*w.floor
		}
		g.since, g.lastAt = 0, t
		was := g.stopped
		switch {
		case !g.stopped && low:
			g.stopped = true
		case g.stopped && resume:
			g.stopped = false
		}
		changed = was != g.stopped
	}
	if g.stopped {
		return false, changed
	}
	g.since += int64(n)
	return true, changed
}

// Free is the last free-space reading of the filesystem nearest its
// floor, and that floor.
func (g *Guard) Free() (free, floor int64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.free, g.floor
}
