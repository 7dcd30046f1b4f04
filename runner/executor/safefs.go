package executor

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// The runner is root; the job user may own the directories it writes into
// and may plant symlinks there. These helpers never follow a symlink the
// user could have made: new directories are walked by file descriptor with
// O_NOFOLLOW, files in a home go through an os.Root on that home (a link
// leading outside is refused), and ownership changes use the descriptor or
// Lchown.

// MkdirOwned creates dir and its missing parents (0755) and hands each new
// directory to uid:gid. Components that already exist are the image's and
// are followed as they are (/home may be a link); every component created
// here is entered with O_NOFOLLOW, so a directory swapped for a symlink
// between mkdir and chown is refused instead of followed.
func MkdirOwned(dir string, uid, gid int) error {
	dir = filepath.Clean(dir)
	if !filepath.IsAbs(dir) {
		return fmt.Errorf("mkdir %s: not an absolute path", dir)
	}
	// The deepest existing ancestor.
	existing := dir
	var missing []string
	for {
		if _, err := os.Stat(existing); err == nil {
			break
		} else if !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("mkdir %s: %w", dir, err)
		}
		if _, err := os.Lstat(existing); err == nil {
			// A dangling symlink where we would create a directory.
			return fmt.Errorf("mkdir %s: %s is a symlink to nowhere; refusing to follow it", dir, existing)
		}
		missing = append(missing, filepath.Base(existing))
		parent := filepath.Dir(existing)
		if parent == existing {
			break
		}
		existing = parent
	}
	if len(missing) == 0 {
		return nil
	}
	fd, err := unix.Open(existing, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", existing, err)
	}
	path := existing
	for i := len(missing) - 1; i >= 0; i-- {
		name := missing[i]
		path = filepath.Join(path, name)
		if err := unix.Mkdirat(fd, name, 0o755); err != nil && !errors.Is(err, unix.EEXIST) {
			unix.Close(fd)
			return fmt.Errorf("mkdir %s: %w", path, err)
		}
		next, err := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		unix.Close(fd)
		if err != nil {
			if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) {
				return fmt.Errorf("mkdir %s: replaced by a symlink or file while being created; refusing to follow it", path)
			}
			return fmt.Errorf("open %s: %w", path, err)
		}
		fd = next
		if uid >= 0 {
			if err := unix.Fchown(fd, uid, gid); err != nil {
				unix.Close(fd)
				return fmt.Errorf("chown %s: %w", path, err)
			}
		}
	}
	unix.Close(fd)
	return nil
}

// homeFile writes data to rel (e.g. ".ssh/dstack_job") inside home, as
// root acting for the user: directories on the way are created 0700 and
// handed to uid:gid (uid < 0: left to root), a link anywhere on the way
// that leads out of home is refused, and an existing final symlink is
// replaced rather than written through. With appendTo the file is appended
// to instead of replaced (the link check still applies).
func homeFile(home, rel string, data []byte, perm os.FileMode, uid, gid int, appendTo bool) error {
	root, err := os.OpenRoot(home)
	if err != nil {
		return fmt.Errorf("open home %s: %w", home, err)
	}
	defer root.Close()
	if d := filepath.Dir(rel); d != "." {
		var sofar string
		for _, part := range strings.Split(d, string(filepath.Separator)) {
			sofar = filepath.Join(sofar, part)
			if err := root.Mkdir(sofar, 0o700); err == nil {
				if uid >= 0 {
					_ = root.Lchown(sofar, uid, gid)
				}
			} else if !errors.Is(err, os.ErrExist) {
				return fmt.Errorf("create %s in %s: %w", sofar, home, err)
			}
			fi, err := root.Lstat(sofar)
			if err != nil {
				return fmt.Errorf("%s in %s: %w", sofar, home, err)
			}
			if !fi.IsDir() {
				return fmt.Errorf("%s in %s is not a directory (a symlink?); refusing to write through it", sofar, home)
			}
		}
	}
	flags := os.O_WRONLY | os.O_CREATE | unix.O_NOFOLLOW
	if appendTo {
		flags |= os.O_APPEND
	} else {
		if fi, err := root.Lstat(rel); err == nil && fi.Mode()&os.ModeSymlink != 0 {
			if err := root.Remove(rel); err != nil {
				return fmt.Errorf("replace the symlink %s in %s: %w", rel, home, err)
			}
		}
		flags |= os.O_TRUNC
	}
	f, err := root.OpenFile(rel, flags, perm)
	if err != nil {
		if errors.Is(err, unix.ELOOP) {
			return fmt.Errorf("%s in %s is a symlink; refusing to write through it", rel, home)
		}
		return fmt.Errorf("write %s in %s: %w", rel, home, err)
	}
	_, err = f.Write(data)
	if err == nil && uid >= 0 {
		err = f.Chown(uid, gid)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("write %s in %s: %w", rel, home, err)
	}
	return nil
}
