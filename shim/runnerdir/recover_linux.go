package runnerdir

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

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
