package runnerdir

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("loop devices need root (CI runs as root)")
		}
		t.Skip("loop devices need root")
	}
}

// dirs returns bounded Dirs of size and a runner dir path; whatever stays
// mounted is detached when the test ends.
func dirs(t *testing.T, size int64) (*Dirs, string) {
	t.Helper()
	needRoot(t)
	dir := filepath.Join(t.TempDir(), "runners", "task-1")
	t.Cleanup(func() {
		for range 4 {
			_ = unix.Unmount(dir, unix.MNT_DETACH)
		}
	})
	d := &Dirs{Size: size}
	t.Cleanup(d.Close)
	return d, dir
}

// fill writes into dir until the filesystem refuses; it returns the bytes
// written and the error.
func fill(t *testing.T, dir string) (int64, error) {
	t.Helper()
	f, err := os.Create(filepath.Join(dir, "fill"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 1<<20)
	var n int64
	for n < 1<<30 {
		w, err := f.Write(buf)
		n += int64(w)
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// A job writing without end meets ENOSPC at the directory's size, on a
// filesystem of its own; the parent's filesystem keeps its room; remove
// takes the mount, the directory and the image.
func TestMakeBoundsTheDirectory(t *testing.T) {
	d, dir := dirs(t, 16<<20)
	var before unix.Statfs_t
	_ = unix.Statfs(filepath.Dir(filepath.Dir(dir)), &before)
	if err := d.Make(context.Background(), dir); err != nil {
		t.Fatal(err)
	}
	if !d.mounted(dir) {
		t.Fatal("not a filesystem of its own")
	}
	n, err := fill(t, dir)
	if !errors.Is(err, syscall.ENOSPC) || n > 16<<20 {
		t.Fatalf("wrote %d bytes, then %v; want ENOSPC within 16 MiB", n, err)
	}
	var mnt unix.Statfs_t
	_ = unix.Statfs(dir, &mnt)
	if mnt.Flags&unix.ST_NOSUID == 0 || mnt.Flags&unix.ST_NODEV == 0 {
		t.Fatalf("mount flags %#x: want nosuid,nodev", mnt.Flags)
	}
	if err := d.Remove(dir); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{dir, imagePath(dir)} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Fatalf("%s left: %v", p, err)
		}
	}
}

// After a reboot (the mount gone, the image kept) Attach brings the job's
// files back. While a container still holds the image's loop device (a
// second mount of it), Attach mounts that same device, never a second
// loop device over the image.
func TestAttachRemountsTheSameImage(t *testing.T) {
	d, dir := dirs(t, 16<<20)
	ctx := context.Background()
	if err := d.Make(ctx, dir); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "job_final.json"), []byte(`{"state":"done"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	// A container's bind of it, then the host's mount goes.
	holder := t.TempDir()
	if err := unix.Mount(dir, holder, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(holder, unix.MNT_DETACH) })
	devBefore, ok := d.backing(imagePath(dir))
	if !ok {
		t.Fatal("no loop device backs the image")
	}
	if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	if err := d.Attach(dir); err != nil {
		t.Fatal(err)
	}
	if dev, _ := d.backing(imagePath(dir)); dev != devBefore {
		t.Fatalf("re-attached on %s, the image is on %s", dev, devBefore)
	}
	if err := d.Attach(dir); err != nil { // idempotent
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "job_final.json")); err != nil || !bytes.Contains(b, []byte("done")) {
		t.Fatalf("job's file after re-attach: %q %v", b, err)
	}
	// The reboot case: no holder, no loop device; a new one, same files.
	_ = unix.Unmount(holder, unix.MNT_DETACH)
	if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	if err := d.Make(ctx, dir); err != nil { // never formats the image again
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "job_final.json")); err != nil || !bytes.Contains(b, []byte("done")) {
		t.Fatalf("job's file after a remount: %q %v", b, err)
	}
	if err := d.Remove(dir); err != nil {
		t.Fatal(err)
	}
}

// A plain directory that already holds files is kept as it is (never
// hidden under a mount); a host that cannot make filesystems gets plain
// directories and one warning.
func TestPlainFallbacks(t *testing.T) {
	d, dir := dirs(t, 16<<20)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	_ = os.WriteFile(filepath.Join(dir, "job.log"), []byte("old"), 0o644)
	if err := d.Make(context.Background(), dir); err != nil {
		t.Fatal(err)
	}
	if d.mounted(dir) {
		t.Fatal("a directory with files was mounted over")
	}

	var log bytes.Buffer
	d = &Dirs{Size: 16 << 20, Mkfs: "/nonexistent/mkfs.ext4", Log: slog.New(slog.NewTextHandler(&log, nil))}
	t.Cleanup(d.Close)
	for _, name := range []string{"a", "b"} {
		p := filepath.Join(t.TempDir(), name)
		if err := d.Make(context.Background(), p); err != nil {
			t.Fatal(err)
		}
		if fi, err := os.Stat(p); err != nil || !fi.IsDir() || d.mounted(p) {
			t.Fatalf("fallback dir %s: %v", p, err)
		}
		if _, err := os.Stat(imagePath(p)); !os.IsNotExist(err) {
			t.Fatalf("image left after a failed make: %v", err)
		}
	}
	if n := strings.Count(log.String(), "not bounded"); n != 1 {
		t.Fatalf("%d warnings, want one: %s", n, log.String())
	}
}

// Every image is a sparse copy of one template, formatted once (in the
// background by Warm): a copy has the template's few blocks, mounts as a
// filesystem of its own, and what one task writes is not in another's;
// a template of another size, or one cut short, is made again.
func TestImagesAreCopiesOfOneTemplate(t *testing.T) {
	d, dir := dirs(t, 16<<20)
	runners := filepath.Dir(dir)
	if err := os.MkdirAll(runners, 0o755); err != nil {
		t.Fatal(err)
	}
	other := filepath.Join(runners, templatePrefix+"999.ext4")
	_ = os.WriteFile(other, []byte("old size"), 0o600)
	d.Warm(runners)
	d.bg.Wait()
	tmpl := d.templatePath(runners)
	if !validImage(tmpl) {
		t.Fatal("no template after Warm")
	}
	if _, err := os.Stat(other); !os.IsNotExist(err) {
		t.Fatalf("the other size's template is left: %v", err)
	}
	dir2 := filepath.Join(runners, "task-2")
	t.Cleanup(func() { _ = unix.Unmount(dir2, unix.MNT_DETACH) })
	for _, p := range []string{dir, dir2} {
		if err := d.Make(context.Background(), p); err != nil || !d.mounted(p) {
			t.Fatalf("make %s: %v", p, err)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "mine"), []byte("task 1"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir2, "mine")); !os.IsNotExist(err) {
		t.Fatalf("one task's file is in the other's dir: %v", err)
	}
	var st unix.Stat_t
	if err := unix.Stat(imagePath(dir2), &st); err != nil || st.Blocks*512 > 4<<20 || st.Size != 16<<20 {
		t.Fatalf("the copy is not sparse: %d bytes allocated of %d (%v)", st.Blocks*512, st.Size, err)
	}
	// A template cut short (a crash while it was made) is made again.
	_ = os.Truncate(tmpl, 100)
	d2 := &Dirs{Size: 16 << 20}
	t.Cleanup(d2.Close)
	dir3 := filepath.Join(runners, "task-3")
	t.Cleanup(func() { _ = unix.Unmount(dir3, unix.MNT_DETACH) })
	if err := d2.Make(context.Background(), dir3); err != nil || !d2.mounted(dir3) || !validImage(tmpl) {
		t.Fatalf("after a template cut short: %v", err)
	}
	for _, p := range []string{dir, dir2, dir3} {
		if err := d.Remove(p); err != nil {
			t.Fatal(err)
		}
	}
}

// spareOf is d's ready copy ("" none).
func spareOf(d *Dirs) string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.spare
}

// waitSpare waits up to 5 s for d's ready copy.
func waitSpare(t *testing.T, d *Dirs, when string) {
	t.Helper()
	for i := 0; spareOf(d) == ""; i++ {
		if i > 500 {
			t.Fatal("no ready copy " + when)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A held start keeps the next ready copy from being made however long it
// takes; the quiet period counts from its release.
func TestReadyCopyWaitsForHeldStarts(t *testing.T) {
	d, dir := dirs(t, 16<<20)
	runners := filepath.Dir(dir)
	d.Warm(runners)
	waitSpare(t, d, "after Warm")
	release := d.Hold()
	if err := d.Make(context.Background(), dir); err != nil || !d.mounted(dir) {
		t.Fatalf("make: %v", err)
	}
	t.Cleanup(func() { _ = d.Remove(dir) })
	time.Sleep(3 * refillQuiet)
	if spareOf(d) != "" {
		t.Fatal("the ready copy was made while a start was held")
	}
	release()
	released := time.Now()
	release() // idempotent: one hold, one release
	d.mu.Lock()
	holds := d.holds
	d.mu.Unlock()
	if holds != 0 {
		t.Fatalf("%d holds after a double release", holds)
	}
	waitSpare(t, d, "after the release")
	if gap := time.Since(released); gap < refillQuiet {
		t.Fatalf("the ready copy came %s after the release, before the quiet period (%s)", gap, refillQuiet)
	}
}

// The next ready copy is made only once starts have paused for
// refillQuiet: its copy and fsync are not done beside a start.
func TestReadyCopyWaitsForAQuietMoment(t *testing.T) {
	d, dir := dirs(t, 16<<20)
	runners := filepath.Dir(dir)
	d.Warm(runners)
	waitSpare(t, d, "after Warm")
	took := time.Now()
	if err := d.Make(context.Background(), dir); err != nil || !d.mounted(dir) {
		t.Fatalf("make: %v", err)
	}
	if spareOf(d) != "" {
		t.Fatal("the ready copy was made again at once, beside the start")
	}
	waitSpare(t, d, "after the quiet period")
	if gap := time.Since(took); gap < refillQuiet {
		t.Fatalf("the ready copy came %s after the start, before the quiet period (%s)", gap, refillQuiet)
	}
	// Close does not wait out a quiet period.
	dir2 := filepath.Join(runners, "task-2")
	t.Cleanup(func() { _ = unix.Unmount(dir2, unix.MNT_DETACH) })
	if err := d.Make(context.Background(), dir2); err != nil {
		t.Fatal(err)
	}
	closed := make(chan struct{})
	go func() { d.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Close waited on the quiet period")
	}
	if left, _ := filepath.Glob(filepath.Join(runners, sparePrefix+"*")); len(left) > 0 {
		t.Fatalf("ready copies left after Close: %v", left)
	}
	for _, p := range []string{dir, dir2} {
		if err := d.Remove(p); err != nil {
			t.Fatal(err)
		}
	}
}

// What the job frees in its runner dir goes back to the host: the image
// shrinks by it once the filesystem has committed.
func TestFreedSpaceLeavesTheImage(t *testing.T) {
	d, dir := dirs(t, 64<<20)
	if err := d.Make(context.Background(), dir); err != nil || !d.mounted(dir) {
		t.Fatalf("make: %v", err)
	}
	t.Cleanup(func() { _ = d.Remove(dir) })
	allocated := func() int64 {
		var st unix.Stat_t
		if err := unix.Stat(imagePath(dir), &st); err != nil {
			t.Fatal(err)
		}
		return st.Blocks * 512
	}
	syncDir := func() {
		f, err := os.Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := unix.Syncfs(int(f.Fd())); err != nil {
			t.Fatal(err)
		}
	}
	empty := allocated()
	big := make([]byte, 16<<20)
	for i := range big {
		big[i] = byte(i)
	}
	if err := os.WriteFile(filepath.Join(dir, "log"), big, 0o644); err != nil {
		t.Fatal(err)
	}
	syncDir()
	full := allocated()
	if full < empty+15<<20 {
		t.Fatalf("16 MiB written: image %d -> %d bytes", empty, full)
	}
	if err := os.Remove(filepath.Join(dir, "log")); err != nil {
		t.Fatal(err)
	}
	syncDir()
	var after int64
	for i := 0; ; i++ { // the discard follows the commit
		if after = allocated(); after < empty+4<<20 {
			break
		}
		if i > 200 {
			t.Fatalf("16 MiB freed in the runner dir: the image still holds %d bytes (%d empty, %d full)", after, empty, full)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("image: empty %d, with 16 MiB %d, after its removal %d bytes", empty, full, after)
}

// A burst of task starts attaches loop devices at once: the kernel hands
// each the same free device and all but one get EBUSY. Every directory
// must still be bounded (a directory that fell back to the shim home's
// disk is one a job can fill).
func TestConcurrentMakesAreAllBounded(t *testing.T) {
	needRoot(t)
	const n = 32
	root := filepath.Join(t.TempDir(), "runners")
	d := &Dirs{Size: 16 << 20}
	t.Cleanup(d.Close)
	paths := taskPaths(t, root, n)
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range paths {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = d.Make(context.Background(), paths[i])
		}()
	}
	wg.Wait()
	unbounded := 0
	for i, p := range paths {
		if errs[i] != nil {
			t.Errorf("%s: %v", p, errs[i])
		}
		if !d.mounted(p) {
			unbounded++
		}
	}
	if unbounded > 0 {
		t.Fatalf("%d of %d runner dirs made at once are not filesystems of their own", unbounded, n)
	}
	for _, p := range paths {
		if err := d.Remove(p); err != nil {
			t.Error(err)
		}
	}
}

// taskPaths names n runner dirs under root; whatever stays mounted there
// is detached when the test ends.
func taskPaths(tb testing.TB, root string, n int) []string {
	paths := make([]string, n)
	for i := range paths {
		paths[i] = filepath.Join(root, "task-"+strconv.Itoa(i))
		tb.Cleanup(func() {
			for range 4 {
				_ = unix.Unmount(paths[i], unix.MNT_DETACH)
			}
		})
	}
	return paths
}

// A runner dir's mount leaves its inode tables as they are (they read as
// zeros: the image is sparse): the kernel's lazy zeroing of them is work
// in the middle of a burst of starts, and writes to every image. (Its
// effect cannot be waited for: the kernel starts it up to 5 s after the
// mount, at random.)
func TestMountLeavesInodeTablesAlone(t *testing.T) {
	d, dir := dirs(t, 64<<20)
	if err := d.Make(context.Background(), dir); err != nil || !d.mounted(dir) {
		t.Fatalf("make: %v", err)
	}
	t.Cleanup(func() { _ = d.Remove(dir) })
	info, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var opts string
	for line := range strings.SplitSeq(string(info), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && f[4] == dir {
			opts = f[len(f)-1] // the superblock's options
		}
	}
	if !slices.Contains(strings.Split(opts, ","), "noinit_itable") {
		t.Fatalf("%s mounted with %q: want noinit_itable", dir, opts)
	}
}
