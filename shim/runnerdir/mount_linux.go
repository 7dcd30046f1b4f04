package runnerdir

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"
)

// Make creates dir for a new task, bounded when it can be, of the size its
// reservation took when the room is still there (room.go). An image left
// there (a start cut short) is attached, never formatted again; a plain
// directory that already holds files (made before bounds, or unbounded)
// is kept as it is.
func (d *Dirs) Make(ctx context.Context, dir string) error {
	if d.Size <= 0 {
		return unbounded(dir)
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
		return unbounded(dir)
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

// mountData mounts each runner dir with online discard: what the job frees
// in its filesystem is punched out of the sparse image as it is freed (the
// filesystem has no journal, so no commit holds the discard back), and the
// host's disk gets it back at once. Without it the image
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
