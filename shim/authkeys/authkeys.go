// Package authkeys adds and removes a task's keys in a host user's
// ~/.ssh/authorized_keys. Every line we add is tagged with the task id, so
// removal deletes only our lines for that task: keys the user or another task
// added stay, even when they are the same key (dstack issue #4174).
package authkeys

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"

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
	dir := filepath.Join(home, ".ssh")
	if _, err := os.Stat(dir); os.IsNotExist(err) {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return fmt.Errorf("create %s: %w", dir, err)
		}
		_ = os.Chown(dir, uid, gid)
	}
	path := filepath.Join(dir, "authorized_keys")
	mode := os.FileMode(0o600)
	owner := [2]int{uid, gid}
	data, err := os.ReadFile(path)
	switch {
	case err == nil:
		if fi, err := os.Stat(path); err == nil {
			mode = fi.Mode().Perm()
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				owner = [2]int{int(st.Uid), int(st.Gid)}
			}
		}
	case os.IsNotExist(err):
	default:
		return fmt.Errorf("read %s: %w", path, err)
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
