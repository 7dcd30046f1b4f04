// Package authkeys adds and removes a task's keys in a host user's
// ~/.ssh/authorized_keys. Every line we add is tagged with the task id, so
// removal deletes only our lines for that task: keys the user or another task
// added stay, even when they are the same key (dstack issue #4174).
package authkeys

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/tandem-run/tandem/common/atomicfile"
)

// Editor edits authorized_keys files; one mutex serializes all edits.
type Editor struct {
	mu sync.Mutex
	// HomeDir resolves a user's home; defaults to the passwd lookup.
	HomeDir func(username string) (home string, uid, gid int, err error)
}

// tag marks a line as added for task id.
func tag(id string) string { return " # tandem task " + id }

// Add appends keys for task id to username's authorized_keys, creating
// ~/.ssh (0700) and the file (0600) owned by the user when missing. Adding the
// same task's keys twice does not duplicate them.
func (e *Editor) Add(username, id string, keys []string) error {
	return e.edit(username, func(lines []string) []string {
		have := map[string]bool{}
		for _, l := range lines {
			have[l] = true
		}
		for _, k := range keys {
			k = strings.TrimSpace(k)
			if k == "" || strings.ContainsAny(k, "\r\n") {
				continue
			}
			line := k + tag(id)
			if !have[line] {
				lines = append(lines, line)
				have[line] = true
			}
		}
		return lines
	})
}

// Remove deletes the lines tagged for task id; running it twice is harmless.
func (e *Editor) Remove(username, id string) error {
	suffix := tag(id)
	return e.edit(username, func(lines []string) []string {
		out := lines[:0]
		for _, l := range lines {
			if !strings.HasSuffix(l, suffix) {
				out = append(out, l)
			}
		}
		return out
	})
}

func (e *Editor) edit(username string, change func([]string) []string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	lookup := e.HomeDir
	if lookup == nil {
		lookup = passwdHome
	}
	home, uid, gid, err := lookup(username)
	if err != nil {
		return fmt.Errorf("host user %q: %w", username, err)
	}
	// The shim is root and the user owns ~/.ssh: it may be a link to
	// another user's (root's) directory, or authorized_keys a link to any
	// file. The directory is opened without following links and every
	// later path goes through that descriptor.
	dir := filepath.Join(home, ".ssh")
	created := false
	if err := os.Mkdir(dir, 0o700); err == nil {
		created = true
	} else if !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("create %s: %w", dir, err)
	}
	dfd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) {
			return fmt.Errorf("%s is not a directory (a symlink?); refusing to edit keys through it", dir)
		}
		return fmt.Errorf("open %s: %w", dir, err)
	}
	defer unix.Close(dfd)
	var st unix.Stat_t
	if err := unix.Fstat(dfd, &st); err != nil {
		return fmt.Errorf("stat %s: %w", dir, err)
	}
	if int(st.Uid) != uid && st.Uid != 0 {
		return fmt.Errorf("%s belongs to uid %d, not to %s (uid %d); refusing to edit it", dir, st.Uid, username, uid)
	}
	if created {
		_ = unix.Fchown(dfd, uid, gid)
	}
	path := fmt.Sprintf("/proc/self/fd/%d/authorized_keys", dfd)
	mode := os.FileMode(0o600)
	owner := [2]int{uid, gid}
	var data []byte
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	switch {
	case err == nil:
		fi, serr := f.Stat()
		if serr == nil && !fi.Mode().IsRegular() {
			serr = errors.New("not a regular file")
		}
		if serr == nil {
			mode = fi.Mode().Perm()
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				owner = [2]int{int(st.Uid), int(st.Gid)}
			}
			data, serr = io.ReadAll(io.LimitReader(f, 16<<20))
		}
		f.Close()
		if serr != nil {
			return fmt.Errorf("read %s/authorized_keys: %w", dir, serr)
		}
	case errors.Is(err, unix.ELOOP):
		return fmt.Errorf("%s/authorized_keys is a symlink; refusing to edit keys through it", dir)
	case os.IsNotExist(err):
	default:
		return fmt.Errorf("read %s/authorized_keys: %w", dir, err)
	}
	var lines []string
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("read %s: %w", path, err)
	}
	lines = change(lines)
	var buf bytes.Buffer
	for _, l := range lines {
		buf.WriteString(l)
		buf.WriteByte('\n')
	}
	// SyncDir: a key line added or revoked must survive a power cut too.
	return atomicfile.WriteBytes(path, buf.Bytes(), atomicfile.Options{Perm: mode, UID: owner[0], GID: owner[1], SyncDir: true})
}

func passwdHome(username string) (string, int, int, error) {
	u, err := user.Lookup(username)
	if err != nil {
		return "", 0, 0, err
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	if u.HomeDir == "" {
		return "", 0, 0, fmt.Errorf("no home directory")
	}
	return u.HomeDir, uid, gid, nil
}
