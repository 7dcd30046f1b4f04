package runnerdir

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

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
