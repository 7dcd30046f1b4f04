package runnerdir

// The room rule: what every runner dir may still grow by never passes what
// the home's filesystem can give above its floor.
//
// A sparse image takes only what is written, and can still take its size
// less what it holds: that is its claim on the host's disk. Each new
// image is sized at submit (Reserve) and again when it is made (Make),
// under one lock, against the filesystem's free space (statfs f_bavail)
// less the floor and less every other image's claim: the images on disk
// (this shim's, a previous run's re-attached after a restart) and the
// reservations of tasks whose image is not made yet.

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// DefaultMinSize is the least a runner dir is made with: the runner's own
// files (its state and the job's final state, which the shim reads after
// the container: kilobytes), the pull log and the first MiBs of the job's
// logs before the runner's floor on the dir (a tenth of it) stops keeping
// them, over ext4's own 1.5 MiB. Smaller, a job's first upload or log
// lines would fail it rather than let it run.
const DefaultMinSize int64 = 16 << 20

// minFloor is what the home keeps free at least: the shim's records (a
// few KiB each: thousands in a few MiB, beside the 8 MiB state reserve
// that holds them when the disk fills anyway) and its logs' next lines.
const minFloor int64 = 16 << 20

// Floor is what a filesystem of total bytes keeps free of runner dirs:
// the runner's own floor for the host's filesystem under its dir (a tenth
// of it, at most 256 MiB: runner/logs.DefaultMinFree), so that runner dirs
// filled to their bound never take the host under the floor where every
// runner stops keeping its job's output; 16 MiB at least.
func Floor(total int64) int64 { return max(minFloor, min(total/10, 256<<20)) }

// Space is what a filesystem has: the bytes free to unprivileged writers
// (f_bavail: the root reserve is left to the host) and its size.
type Space struct {
	Free, Total int64
}

// StatfsSpace is path's filesystem's Space.
func StatfsSpace(path string) (Space, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return Space{}, err
	}
	return Space{Free: int64(st.Bavail) * int64(st.Bsize), Total: int64(st.Blocks) * int64(st.Bsize)}, nil
}

// ErrNoRoom classes NoRoomError: a runner dir refused for want of room.
var ErrNoRoom = errors.New("no room on the shim home's disk for another runner dir")

// NoRoomError is a runner dir refused for want of room; its text, meant
// for the client, says what the home has and the rule, never a path.
type NoRoomError struct {
	Free    int64 // the filesystem's free bytes
	Floor   int64 // what it keeps free
	Claimed int64 // what the other runner dirs may still grow by
	Min     int64 // the least a runner dir is made with
}

func (e *NoRoomError) Error() string {
	return fmt.Sprintf("%v: it has %s free, keeps %s free (its floor), and the runner dirs already made may still grow by %s; a runner dir needs at least %s: free space in its home or remove ended tasks",
		ErrNoRoom, mib(e.Free), mib(e.Floor), mib(e.Claimed), mib(e.Min))
}

func (e *NoRoomError) Is(target error) bool { return target == ErrNoRoom }

func mib(n int64) string { return fmt.Sprintf("%d MiB", n>>20) }

// decide sizes a new runner dir of want bytes (at least minSize) on sp,
// where the other dirs may still grow by claimed. A new dir (share) gets
// want when twice that is left, else half of what is left: a host short
// of room still starts the next few tasks, each with less, rather than
// giving the first one all of it. A dir sized before (its reservation,
// want) keeps its size when it still fits, else takes what is left.
// Either way not under minSize: refused.
func decide(want, minSize int64, sp Space, claimed int64, share bool) (int64, error) {
	floor := Floor(sp.Total)
	left := sp.Free - floor - claimed
	if left < minSize {
		return 0, &NoRoomError{Free: sp.Free, Floor: floor, Claimed: claimed, Min: minSize}
	}
	size := want
	if share && left < 2*want {
		size = left / 2
	} else if left < want {
		size = left
	}
	size = max(size&^(1<<20-1), minSize) // whole MiBs: readable sizes, whole ext4 groups
	return min(size, want), nil
}

// booking is a dir's room, taken before its image is on disk.
type booking struct{ size int64 }

// Reserve takes the room of dir's filesystem before its task is accepted,
// so that two submits never both count on the same space; the task is
// refused (ErrNoRoom) when there is not enough. release gives the room
// back (the task was not accepted, or its start ended); once the image is
// made it is counted from the disk, and release is harmless. A no-op
// unbounded, or where dir's image is already there (a start cut short:
// counted from the disk).
func (d *Dirs) Reserve(dir string) (release func(), err error) {
	if d.Size <= 0 {
		return func() {}, nil
	}
	if _, err := os.Lstat(imagePath(dir)); err == nil {
		return func() {}, nil
	}
	d.roomMu.Lock()
	defer d.roomMu.Unlock()
	size, err := d.decideLocked(dir, d.Size, true)
	if err != nil {
		return nil, err
	}
	b := &booking{size: size}
	if d.booked == nil {
		d.booked = map[string]*booking{}
	}
	d.booked[dir] = b
	return func() { d.unbook(dir, b) }, nil
}

// unbook drops b, dir's booking, unless another has replaced it.
func (d *Dirs) unbook(dir string, b *booking) {
	d.roomMu.Lock()
	defer d.roomMu.Unlock()
	if d.booked[dir] == b {
		delete(d.booked, dir)
	}
}

// sizeFor decides the size of dir's new image, Make's check: its booking
// when it still fits (things other than runner dirs may have taken room
// since the submit), else what is left, else ErrNoRoom; a dir not booked
// is sized as a new one. The size stays booked until done is called,
// once the image is on disk or was not made.
func (d *Dirs) sizeFor(dir string) (size int64, done func(), err error) {
	d.roomMu.Lock()
	defer d.roomMu.Unlock()
	want, share := d.Size, true
	if b, ok := d.booked[dir]; ok {
		want, share = b.size, false
	}
	if size, err = d.decideLocked(dir, want, share); err != nil {
		return 0, nil, err
	}
	b := &booking{size: size}
	if d.booked == nil {
		d.booked = map[string]*booking{}
	}
	d.booked[dir] = b
	return size, func() { d.unbook(dir, b) }, nil
}

// decideLocked sizes dir's image against its filesystem and every other
// dir's claim. The claims are read before the free space: a write in
// between lowers what is free after its image's claim was counted, and
// the error is on the safe side. Called with roomMu held.
func (d *Dirs) decideLocked(dir string, want int64, share bool) (int64, error) {
	runners := filepath.Dir(dir)
	claimed, err := d.claimedLocked(runners, dir)
	if err != nil {
		return 0, fmt.Errorf("runner dirs' room: %w", err)
	}
	sp, err := d.space(runners)
	if err != nil {
		return 0, fmt.Errorf("runner dirs' room: %w", err)
	}
	// A configured size under the least is the operator's: it is the least.
	return decide(want, min(d.minSize(), d.Size), sp, claimed, share)
}

// claimedLocked is what the runner dirs in runners other than self may
// still grow by: each image on disk its size less what it holds, each
// booked dir its booked size (its image, when there, may be partly
// written: counted whole, on the safe side). The template and the ready
// copy are never mounted: they hold what they hold, already out of the
// free space. Called with roomMu held.
func (d *Dirs) claimedLocked(runners, self string) (int64, error) {
	entries, err := os.ReadDir(runners)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return 0, err
	}
	var claimed int64
	for _, e := range entries {
		name := e.Name()
		if strings.HasPrefix(name, ".") || !strings.HasSuffix(name, ".ext4") || !e.Type().IsRegular() {
			continue
		}
		dir := filepath.Join(runners, strings.TrimSuffix(name, ".ext4"))
		if _, ok := d.booked[dir]; ok || dir == self {
			continue
		}
		fi, err := e.Info()
		if err != nil {
			continue // removed since
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			continue
		}
		claimed += max(0, fi.Size()-st.Blocks*512)
	}
	for dir, b := range d.booked {
		if dir != self && filepath.Dir(dir) == runners {
			claimed += b.size
		}
	}
	return claimed, nil
}

// space reads the free space of the filesystem runners is (or will be)
// on: the nearest directory that exists, before the first task made it.
func (d *Dirs) space(runners string) (Space, error) {
	statfs := d.Statfs
	if statfs == nil {
		statfs = StatfsSpace
	}
	p := runners
	for {
		if _, err := os.Stat(p); err == nil || filepath.Dir(p) == p {
			break
		}
		p = filepath.Dir(p)
	}
	return statfs(p)
}

func (d *Dirs) minSize() int64 {
	if d.MinSize > 0 {
		return d.MinSize
	}
	return DefaultMinSize
}
