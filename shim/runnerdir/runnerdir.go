// Package runnerdir makes each task's runner directory a filesystem of its
// own, of a fixed size: an ext4 image beside it (sparse: it takes only what
// is written), attached to a loop device and mounted nosuid,nodev. The job
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
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
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

	warned sync.Once

	// One formatted image is kept ready beside the runner dirs, so a task
	// start mounts one instead of waiting for mkfs (4-5 ms of a ~90 ms
	// start); it is made again in the background after each use.
	spareMu sync.Mutex
	spare   string // its path ("" none)
	making  bool
	closed  bool
	bg      sync.WaitGroup
}

// Close waits for the ready image being made and removes it; no other is
// made after.
func (d *Dirs) Close() {
	d.spareMu.Lock()
	d.closed = true
	d.spareMu.Unlock()
	d.bg.Wait()
	d.spareMu.Lock()
	if d.spare != "" {
		_ = os.Remove(d.spare)
		d.spare = ""
	}
	d.spareMu.Unlock()
}

// sparePrefix names the ready image in the runners directory.
const sparePrefix = ".spare-"

// Warm makes the ready image in runners (the runner dirs' parent) in the
// background, first removing any a previous run left. A no-op unbounded.
func (d *Dirs) Warm(runners string) {
	if d.Size <= 0 {
		return
	}
	d.refill(runners)
}

func (d *Dirs) refill(runners string) {
	d.spareMu.Lock()
	if d.making || d.spare != "" || d.closed {
		d.spareMu.Unlock()
		return
	}
	d.making = true
	d.bg.Add(1)
	d.spareMu.Unlock()
	go func() {
		defer d.bg.Done()
		// Only this shim makes images here: any other spare is a previous
		// run's, maybe cut short.
		old, _ := filepath.Glob(filepath.Join(runners, sparePrefix+"*"))
		for _, o := range old {
			_ = os.Remove(o)
		}
		var b [6]byte
		_, _ = rand.Read(b[:])
		p := filepath.Join(runners, sparePrefix+hex.EncodeToString(b[:])+".ext4")
		err := os.MkdirAll(runners, 0o755)
		if err == nil {
			err = d.format(context.Background(), p, true)
		}
		d.spareMu.Lock()
		d.making = false
		if err == nil {
			d.spare = p
		}
		d.spareMu.Unlock()
	}()
}

// takeSpare moves the ready image, if there is one beside img, to img.
func (d *Dirs) takeSpare(img string) bool {
	d.spareMu.Lock()
	s := d.spare
	if filepath.Dir(s) != filepath.Dir(img) {
		d.spareMu.Unlock()
		return false
	}
	d.spare = ""
	d.spareMu.Unlock()
	if err := os.Rename(s, img); err != nil {
		_ = os.Remove(s)
		return false
	}
	return true
}

// imagePath is where dir's filesystem image lives: beside it, out of the
// job's reach.
func imagePath(dir string) string { return dir + ".ext4" }

// Make creates dir for a new task, bounded when it can be. An image left
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
	if err := d.create(ctx, dir); err != nil {
		d.warned.Do(func() {
			d.log().Warn("runner directories are not bounded on this host (each job can fill the shim home's disk through its own): making a filesystem of its own failed",
				"err", err, "size_bytes", d.Size)
		})
		return os.MkdirAll(dir, 0o755)
	}
	return nil
}

// create mounts the ready image on dir, or formats a new one (created
// here, so nothing is ever formatted over); then the next ready image is
// made.
func (d *Dirs) create(ctx context.Context, dir string) error {
	img := imagePath(dir)
	if err := os.MkdirAll(filepath.Dir(img), 0o755); err != nil {
		return err
	}
	var err error
	if !d.takeSpare(img) {
		err = d.format(ctx, img, false)
	}
	if err == nil {
		err = os.MkdirAll(dir, 0o755)
	}
	if err == nil {
		err = d.mount(img, dir)
	}
	if err != nil {
		_ = os.Remove(img)
		return err
	}
	d.refill(filepath.Dir(img))
	return nil
}

// format makes a new image at img (O_EXCL: never over a file); in the
// background, at the lowest CPU priority.
func (d *Dirs) format(ctx context.Context, img string, background bool) error {
	f, err := os.OpenFile(img, os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o600)
	if err != nil {
		return fmt.Errorf("runner dir image: %w", err)
	}
	err = f.Truncate(d.Size)
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
	return nil
}

// Bounded says whether dir is a filesystem of its own.
func (d *Dirs) Bounded(dir string) bool { return d.mounted(dir) }

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
		if err := unix.Mount(dev, dir, "ext4", unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
			return fmt.Errorf("mount %s on %s: %w", dev, dir, err)
		}
		return nil
	}
	loop, err := attachLoop(img)
	if err != nil {
		return err
	}
	// The loop device clears itself when its last user goes: the mount,
	// once this descriptor is closed.
	defer loop.Close()
	if err := unix.Mount(loop.Name(), dir, "ext4", unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
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
func attachLoop(img string) (*os.File, error) {
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
	for range 16 { // another attach may take the free device first
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
	return nil, errors.New("no free loop device")
}

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
