// Package runnerdir makes each task's runner directory a filesystem of its
// own, of a bounded size: an ext4 image beside it (sparse: it takes only
// what is written), attached to a loop device and mounted nosuid,nodev,discard
// (what the job frees goes back to the host's disk). Its size is the
// configured one where the host has room for it, less where it has not,
// and a task is refused where there is no room at all: what every image
// may still grow by never passes what the disk has above its floor
// (room.go). The job
// runs as root and writes straight into its runner directory (bound into
// the container at /tmp/runner); with a filesystem of its own it meets
// ENOSPC there, in its own space, and the shim home's disk, which other
// tenants' records and logs share, keeps its room. The image outlives the
// container (the shim reads the job's final state and kept log after it)
// and a reboot (re-attached on demand); it goes with the task.
//
// Where the host cannot do it (no loop devices or mkfs.ext4, as in a
// container without privileges), directories are plain and unbounded, and
// the shim says so once.
//
// The files are its jobs: the room rule (room.go), the template image and
// its copies (template_linux.go), the ready copy kept in the background
// (spare_linux.go), making, mounting and removing a dir (mount_linux.go),
// and re-attaching one after a restart (recover_linux.go).
package runnerdir

import (
	"log/slog"
	"os"
	"sync"
	"time"
)

// DefaultSize fits what a job's runner directory legitimately holds: the
// uploads (1 GiB in all), the two logs (32 MiB each) and the runner's own
// files, with room to spare.
const DefaultSize int64 = 2 << 30

// Dirs makes and removes runner directories.
type Dirs struct {
	// Size of each directory's filesystem; ≤ 0: plain directories.
	Size int64
	Log  *slog.Logger
	// Mkfs is the mkfs.ext4 to run ("mkfs.ext4" from PATH when empty).
	Mkfs string
	// SysBlock is /sys/block (a fixture root in tests).
	SysBlock string
	// Statfs reads the runner dirs' filesystem (StatfsSpace when nil).
	Statfs func(path string) (Space, error)
	// MinSize is the least a dir is made with (DefaultMinSize when ≤ 0;
	// Size when that is less): under it, no room (room.go).
	MinSize int64

	warned sync.Once

	roomMu sync.Mutex          // one room decision at a time (room.go)
	booked map[string]*booking // by dir: room taken, image not yet on disk; guarded by roomMu

	// One formatted image, the template, is kept beside the runner dirs;
	// each task's image is a sparse copy of its few written blocks (about
	// a millisecond, no process) rather than a mkfs of its own (a fork and
	// exec, 4-8 ms of CPU: 64 of them at once took the CPU from the API).
	tmplMu sync.Mutex // one template made at a time
	loopMu sync.Mutex // one loop attach at a time (attachLoop)

	// One copy is kept ready (copied and synced in the background after
	// each use): a start renames it into place, and its mount does not
	// wait for the copy's writeback.
	mu       sync.Mutex // guards the fields below
	spare    string     // the ready copy's path ("" none)
	making   bool       // a ready copy is being made
	closed   bool       // nothing more is made in the background
	lastTake time.Time  // when a start last took a ready copy or ended
	holds    int        // container starts under way (Hold)
	quit     chan struct{}
	bg       sync.WaitGroup
}

// imagePath is where dir's filesystem image lives: beside it, out of the
// job's reach.
func imagePath(dir string) string { return dir + ".ext4" }

// unbounded makes dir a plain directory, the one fallback: where runner
// dirs are not bounded (Size ≤ 0, a zero Dirs) and where making its
// filesystem failed.
func unbounded(dir string) error { return os.MkdirAll(dir, 0o755) }

func (d *Dirs) log() *slog.Logger {
	if d.Log == nil {
		return slog.New(slog.DiscardHandler)
	}
	return d.Log
}
