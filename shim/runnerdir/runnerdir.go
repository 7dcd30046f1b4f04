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
package runnerdir

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
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

// refillQuiet is how long the next ready copy waits after the last start
// took one or ended: its copy and fsync beside Docker's start (which syncs
// its own metadata) cost that start 3-6 ms, and a burst of starts needs the
// CPU more than a ready copy it would take at once.
const refillQuiet = 150 * time.Millisecond

// Hold keeps the next ready copy from being made until release is called:
// a container start is under way. A fixed quiet period alone was not
// enough: where Docker's start of a bridge container takes most of a
// second (a slow host, a busy engine) the copy landed in its middle, and
// its thread's low priority counts for nothing against Docker's processes
// in other scheduling groups (autogroups, cgroups). release is idempotent;
// the quiet period counts from it.
func (d *Dirs) Hold() (release func()) {
	d.mu.Lock()
	d.holds++
	d.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			d.mu.Lock()
			d.holds--
			d.lastTake = time.Now()
			d.mu.Unlock()
		})
	}
}

// backgroundLocked runs f in the background unless closed, counted for Close.
// Called with d.mu held.
func (d *Dirs) backgroundLocked(f func()) bool {
	if d.closed {
		return false
	}
	d.bg.Add(1)
	go func() {
		defer d.bg.Done()
		f()
	}()
	return true
}

// sparePrefix names the ready copy in the runners directory.
const sparePrefix = ".ready-"

// refill makes the next ready copy in runners in the background.
func (d *Dirs) refill(runners string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.making || d.spare != "" {
		return
	}
	if d.quit == nil {
		d.quit = make(chan struct{})
	}
	quit := d.quit
	d.making = d.backgroundLocked(func() {
		for { // wait for a quiet moment: no start for refillQuiet
			d.mu.Lock()
			wait := refillQuiet - time.Since(d.lastTake)
			if d.holds > 0 {
				wait = refillQuiet
			}
			d.mu.Unlock()
			if wait <= 0 {
				break
			}
			select {
			case <-quit:
				d.mu.Lock()
				d.making = false
				d.mu.Unlock()
				return
			case <-time.After(wait):
			}
		}
		lowPriority()
		p := filepath.Join(runners, fmt.Sprintf("%s%d.ext4", sparePrefix, os.Getpid()))
		_ = os.Remove(p)
		tmpl, err := d.template(context.Background(), runners, true)
		if err == nil {
			err = copySparse(tmpl, p)
		}
		if err == nil {
			err = syncFile(p)
		}
		d.mu.Lock()
		d.making = false
		if err == nil {
			d.spare = p
		} else {
			_ = os.Remove(p)
		}
		d.mu.Unlock()
	})
}

// lowPriority gives the calling goroutine a thread of its own in the idle
// I/O class, for the rest of its life: the thread is never unlocked, so Go
// ends it with the goroutine and no other goroutine runs in that class. Its
// CPU priority is left alone: the shim runs Go code on one P on small
// hosts (common/procs), and a nice-19 thread that the kernel preempts
// while it holds that P stalls every goroutine of the shim, the API's
// included, until a busy host gives it the CPU again. The copy's work is
// the kernel's (copy_file_range, fsync), done in system calls that hand
// the P on.
func lowPriority() {
	runtime.LockOSThread()
	tid := unix.Gettid()
	const ioprioWhoProcess, ioprioClassIdle, ioprioClassShift = 1, 3, 13
	_, _, _ = unix.Syscall(unix.SYS_IOPRIO_SET, ioprioWhoProcess, uintptr(tid), ioprioClassIdle<<ioprioClassShift)
}

// takeSpare moves the ready copy, when there is one beside img, to img.
func (d *Dirs) takeSpare(img string) bool {
	d.mu.Lock()
	d.lastTake = time.Now()
	s := d.spare
	if s == "" || filepath.Dir(s) != filepath.Dir(img) {
		d.mu.Unlock()
		return false
	}
	d.spare = ""
	d.mu.Unlock()
	if err := os.Rename(s, img); err != nil {
		_ = os.Remove(s)
		return false
	}
	return true
}

func syncFile(p string) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// templatePrefix names the template in the runners directory; its name
// carries its size, so a changed --runner-dir-size makes a new one.
const templatePrefix = ".template-"

func (d *Dirs) templatePath(runners string) string {
	return filepath.Join(runners, fmt.Sprintf("%s%d.ext4", templatePrefix, d.Size))
}

// Warm makes the template in runners (the runner dirs' parent) in the
// background, at the lowest CPU priority, removing those a previous run
// of another size left. A no-op unbounded.
func (d *Dirs) Warm(runners string) {
	if d.Size <= 0 {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.backgroundLocked(func() {
		old, _ := filepath.Glob(filepath.Join(runners, templatePrefix+"*"))
		for _, o := range old {
			if o != d.templatePath(runners) {
				_ = os.Remove(o)
			}
		}
		// Ready copies a previous run left: this shim makes its own.
		ready, _ := filepath.Glob(filepath.Join(runners, sparePrefix+"*"))
		for _, o := range ready {
			_ = os.Remove(o)
		}
		if _, err := d.template(context.Background(), runners, true); err == nil {
			d.refill(runners)
		}
	})
}

// Close waits for the template or ready copy being made, and removes the
// ready copy; none is made after.
func (d *Dirs) Close() {
	d.mu.Lock()
	d.closed = true
	if d.quit != nil {
		close(d.quit)
		d.quit = nil
	}
	d.mu.Unlock()
	d.bg.Wait()
	d.mu.Lock()
	if d.spare != "" {
		_ = os.Remove(d.spare)
		d.spare = ""
	}
	d.mu.Unlock()
}

// template returns the template in runners, formatting it first when it is
// not there (one at a time: concurrent starts wait for the one format).
func (d *Dirs) template(ctx context.Context, runners string, background bool) (string, error) {
	d.tmplMu.Lock()
	defer d.tmplMu.Unlock()
	p := d.templatePath(runners)
	if fi, err := os.Stat(p); err == nil && fi.Size() == d.Size && validImage(p) {
		return p, nil // made before (written under a temp name, then renamed: whole)
	}
	if err := os.MkdirAll(runners, 0o755); err != nil {
		return "", err
	}
	tmp := fmt.Sprintf("%s.tmp-%d", p, os.Getpid())
	_ = os.Remove(tmp)
	if err := d.format(ctx, tmp, d.Size, background); err != nil {
		return "", err
	}
	if err := os.Rename(tmp, p); err != nil {
		_ = os.Remove(tmp)
		return "", err
	}
	return p, nil
}

// validImage says whether path starts like an ext4 image (its superblock's
// magic): a template cut short is made again.
func validImage(path string) bool {
	f, err := os.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	var magic [2]byte
	_, err = f.ReadAt(magic[:], 1024+0x38)
	return err == nil && magic == [2]byte{0x53, 0xef}
}

// imagePath is where dir's filesystem image lives: beside it, out of the
// job's reach.
func imagePath(dir string) string { return dir + ".ext4" }

// Make creates dir for a new task, bounded when it can be, of the size its
// reservation took when the room is still there (room.go). An image left
// there (a start cut short) is attached, never formatted again; a plain
// directory that already holds files (made before bounds, or unbounded)
// is kept as it is.
func (d *Dirs) Make(ctx context.Context, dir string) error {
	if d.Size <= 0 {
		return os.MkdirAll(dir, 0o755)
	}
	if err := d.Attach(dir); err != nil || d.mounted(dir) {
		return err
	}
	if entries, err := os.ReadDir(dir); err == nil && len(entries) > 0 {
		return nil
	}
	// Sized against the room left (room.go); no room is the task's
	// error, never an unbounded dir.
	size, done, err := d.sizeFor(dir)
	if err != nil {
		return err
	}
	defer done()
	if err := d.create(ctx, dir, size); err != nil {
		d.warned.Do(func() {
			d.log().Warn("runner directories are not bounded on this host (each job can fill the shim home's disk through its own): making a filesystem of its own failed",
				"err", err, "size_bytes", d.Size)
		})
		return os.MkdirAll(dir, 0o755)
	}
	return nil
}

// create makes dir's image, a sparse copy of the template (created here,
// so nothing is ever formatted over), and mounts it on dir.
func (d *Dirs) create(ctx context.Context, dir string, size int64) error {
	img := imagePath(dir)
	if err := os.MkdirAll(filepath.Dir(img), 0o755); err != nil {
		return err
	}
	var err error
	switch {
	case size != d.Size:
		// Less room than the configured size: a size of its own, made
		// by a mkfs (a host short of room is not where bursts start).
		err = d.format(ctx, img, size, false)
	case !d.takeSpare(img):
		var tmpl string
		if tmpl, err = d.template(ctx, filepath.Dir(img), false); err == nil {
			err = copySparse(tmpl, img)
		}
	}
	if err == nil {
		err = os.MkdirAll(dir, 0o755)
	}
	if err == nil {
		// A new image: no loop device can back it yet, so the search
		// through every loop device's backing file (1 ms with 64 of them)
		// is skipped.
		err = d.attachAndMount(img, dir)
	}
	if err != nil {
		_ = os.Remove(img)
		return err
	}
	d.refill(filepath.Dir(img))
	return nil
}

// copySparse makes dst (O_EXCL: never over a file) a copy of src that has
// its holes: only the data extents are copied.
func copySparse(src, dst string) (err error) {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	fi, err := in.Stat()
	if err != nil {
		return err
	}
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("runner dir image: %w", err)
	}
	defer func() {
		if cerr := out.Close(); err == nil {
			err = cerr
		}
	}()
	size := fi.Size()
	if err := out.Truncate(size); err != nil {
		return err
	}
	inFd, outFd := int(in.Fd()), int(out.Fd())
	for off := int64(0); off < size; {
		data, err := unix.Seek(inFd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // holes to the end
		}
		if err != nil {
			return fmt.Errorf("copy image: %w", err)
		}
		hole, err := unix.Seek(inFd, data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("copy image: %w", err)
		}
		for r, w := data, data; r < hole; {
			n, err := unix.CopyFileRange(inFd, &r, outFd, &w, int(hole-r), 0)
			if err != nil {
				return fmt.Errorf("copy image: %w", err)
			}
			if n == 0 {
				return errors.New("copy image: short copy")
			}
		}
		off = hole
	}
	return nil
}

// format makes a new image of size at img (O_EXCL: never over a file); in
// the background, at the lowest CPU priority.
func (d *Dirs) format(ctx context.Context, img string, size int64, background bool) error {
	f, err := os.OpenFile(img, os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o600)
	if err != nil {
		return fmt.Errorf("runner dir image: %w", err)
	}
	err = f.Truncate(size)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		mkfs := d.Mkfs
		if mkfs == "" {
			mkfs = "mkfs.ext4"
		}
		// No journal (a scratch filesystem; what must survive a crash is
		// the shim's own records), no root reserve (the job is root),
		// nothing initialised ahead (lazy), no discard of the sparse file.
		cmd := exec.CommandContext(ctx, mkfs, "-q", "-F", "-O", "^has_journal", "-m", "0",
			"-E", "lazy_itable_init=1,nodiscard", img)
		var out strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &out
		xerr := cmd.Start()
		if xerr == nil {
			if background {
				// The ready image is made while a task starts: it yields
				// the CPU to that start.
				_ = unix.Setpriority(unix.PRIO_PROCESS, cmd.Process.Pid, 19)
			}
			xerr = cmd.Wait()
		}
		if xerr != nil {
			err = fmt.Errorf("mkfs.ext4: %w: %s", xerr, strings.TrimSpace(out.String()))
		}
	}
	if err != nil {
		_ = os.Remove(img)
	}
	return err
}

// Attach mounts dir's image on dir when it is not mounted (after a reboot,
// or a start cut short): on the loop device that already backs the image
// if one does (a running container may hold it: a second loop device over
// the same image would corrupt it), else on a new one. No image: nothing
// to do. Idempotent.
func (d *Dirs) Attach(dir string) error {
	img := imagePath(dir)
	if _, err := os.Stat(img); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if d.mounted(dir) {
		return nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	return d.mount(img, dir)
}

// Remove unmounts dir and removes it with its image.
func (d *Dirs) Remove(dir string) error {
	for d.mounted(dir) {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			return fmt.Errorf("unmount runner dir: %w", err)
		}
	}
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	if err := os.Remove(imagePath(dir)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	d.roomMu.Lock()
	delete(d.booked, dir) // a task removed before its start made the image
	d.roomMu.Unlock()
	return nil
}

// mounted says whether dir is a mount point (another device than its
// parent's).
func (d *Dirs) mounted(dir string) bool {
	var st, pst unix.Stat_t
	if unix.Lstat(dir, &st) != nil || unix.Stat(filepath.Dir(dir), &pst) != nil {
		return false
	}
	return st.Mode&unix.S_IFMT == unix.S_IFDIR && st.Dev != pst.Dev
}

// mount attaches img to a loop device (the one already backing it, if
// any) and mounts it on dir.
func (d *Dirs) mount(img, dir string) error {
	if dev, ok := d.backing(img); ok {
		if err := unix.Mount(dev, dir, "ext4", unix.MS_NOSUID|unix.MS_NODEV, mountData); err != nil {
			return fmt.Errorf("mount %s on %s: %w", dev, dir, err)
		}
		return nil
	}
	return d.attachAndMount(img, dir)
}

// mountData mounts each runner dir with online discard: what the job frees
// in its filesystem is punched out of the sparse image at the next journal
// commit, so the host's disk gets it back at once. Without it the image
// keeps every block it ever held: a job log that rotated under its cap
// held 20-25 MB more of a 128 MiB shim home from one run to the next.
//
// And without the kernel's background zeroing of inode tables
// (noinit_itable): mkfs left them unwritten (lazy_itable_init), and in a
// sparse image made from a sparse template what was never written reads
// as zeros already. With it, each mount set the kernel's ext4lazyinit
// thread zeroing 32 MiB of tables a 2 GiB image has (as hole punches on
// the image, then a write of every group descriptor): 0.10-0.17 CPU-s
// after 64 mounts at once, in the middle of a burst of starts.
const mountData = "discard,noinit_itable"

// attachAndMount attaches img to a new loop device and mounts it on dir.
func (d *Dirs) attachAndMount(img, dir string) error {
	loop, err := d.attachLoop(img)
	if err != nil {
		return err
	}
	// The loop device clears itself when its last user goes: the mount,
	// once this descriptor is closed.
	defer loop.Close()
	if err := unix.Mount(loop.Name(), dir, "ext4", unix.MS_NOSUID|unix.MS_NODEV, mountData); err != nil {
		return fmt.Errorf("mount %s on %s: %w", loop.Name(), dir, err)
	}
	return nil
}

// backing finds a loop device whose backing file is img.
func (d *Dirs) backing(img string) (string, bool) {
	root := d.SysBlock
	if root == "" {
		root = "/sys/block"
	}
	abs, err := filepath.EvalSymlinks(img)
	if err != nil {
		return "", false
	}
	matches, _ := filepath.Glob(filepath.Join(root, "loop*", "loop", "backing_file"))
	for _, m := range matches {
		b, err := os.ReadFile(m)
		if err == nil && strings.TrimSpace(string(b)) == abs {
			return "/dev/" + filepath.Base(filepath.Dir(filepath.Dir(m))), true
		}
	}
	return "", false
}

// attachLoop binds img to a free loop device, which clears itself when
// no longer used; the returned file holds it until closed.
//
// The kernel names the same free device to every attach that asks before
// one binds it, and the others get EBUSY: a burst of task starts did, and
// with a fixed 16 tries the 17th in line fell back to an unbounded
// directory. This shim's attaches take turns (loopMu), and one that
// another process beats tries again after a growing pause, for about 2 s.
func (d *Dirs) attachLoop(img string) (*os.File, error) {
	d.loopMu.Lock()
	defer d.loopMu.Unlock()
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("loop devices: %w", err)
	}
	defer ctl.Close()
	backing, err := os.OpenFile(img, os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer backing.Close()
	pause := time.Millisecond
	for try := range loopTries {
		if try > 0 { // another process took the free device first
			time.Sleep(pause)
			pause = min(2*pause, 100*time.Millisecond)
		}
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return nil, fmt.Errorf("free loop device: %w", err)
		}
		loop, err := os.OpenFile(fmt.Sprintf("/dev/loop%d", n), os.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, fmt.Errorf("loop device: %w", err)
		}
		cfg := unix.LoopConfig{Fd: uint32(backing.Fd())}
		cfg.Info.Flags = unix.LO_FLAGS_AUTOCLEAR
		err = unix.IoctlLoopConfigure(int(loop.Fd()), &cfg)
		if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOTTY) {
			// Before Linux 5.8: set the file, then the flags.
			if err = unix.IoctlSetInt(int(loop.Fd()), unix.LOOP_SET_FD, int(backing.Fd())); err == nil {
				if err = unix.IoctlLoopSetStatus64(int(loop.Fd()), &cfg.Info); err != nil {
					_ = unix.IoctlSetInt(int(loop.Fd()), unix.LOOP_CLR_FD, 0)
				}
			}
		}
		if errors.Is(err, unix.EBUSY) {
			loop.Close()
			continue
		}
		if err != nil {
			loop.Close()
			return nil, fmt.Errorf("attach %s to a loop device: %w", img, err)
		}
		return loop, nil
	}
	return nil, fmt.Errorf("no free loop device after %d tries: each one was taken first", loopTries)
}

// loopTries bounds attachLoop's tries: about 2 s of pauses.
const loopTries = 28

func (d *Dirs) log() *slog.Logger {
	if d.Log == nil {
		return slog.New(slog.DiscardHandler)
	}
	return d.Log
}

// SharesMounts says (nil) whether the Docker daemon behind the unix
// socket sees this process's mounts: a runner dir mounted here is what
// the daemon binds into the container only when both live in one mount
// namespace (a shim started through `ip netns exec`, or under systemd's
// PrivateTmp, does not: the container would get the empty directory
// beneath the mount). The daemon is found by the socket's peer
// credentials.
func SharesMounts(socket string) error {
	if socket == "" {
		socket = "/var/run/docker.sock"
	}
	conn, err := net.DialTimeout("unix", socket, 5*time.Second)
	if err != nil {
		return fmt.Errorf("docker socket: %w", err)
	}
	defer conn.Close()
	raw, err := conn.(*net.UnixConn).SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return err
	}
	if credErr != nil {
		return fmt.Errorf("docker daemon's credentials: %w", credErr)
	}
	mine, err := os.Readlink("/proc/self/ns/mnt")
	if err != nil {
		return err
	}
	theirs, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", cred.Pid))
	if err != nil {
		return fmt.Errorf("docker daemon (pid %d) mount namespace: %w", cred.Pid, err)
	}
	if mine != theirs {
		return fmt.Errorf("the docker daemon (pid %d) is in another mount namespace (%s, this shim %s)", cred.Pid, theirs, mine)
	}
	return nil
}
