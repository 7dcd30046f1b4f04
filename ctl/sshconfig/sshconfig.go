// Package sshconfig keeps tandem's own ssh config file: one Host entry per
// task, each opened by a "# tandem task ID shim ADDR" marker line, edited
// under an exclusive lock and replaced atomically (common/atomicfile); and
// the Include line that makes the user's ~/.ssh/config read it.
package sshconfig

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/tandem-run/tandem/common/atomicfile"
	"github.com/tandem-run/tandem/common/ident"
)

// header opens the file; everything but the entries is rewritten.
const header = "# Written by tandem: one Host per task (tandem ssh-config). Edits are lost.\n\n"

// DefaultPath is $TANDEM_SSH_CONFIG, else ~/.tandem/ssh_config.
func DefaultPath() (string, error) {
	if p := os.Getenv("TANDEM_SSH_CONFIG"); p != "" {
		return p, nil
	}
	home, err := os.UserHomeDir()
	if err != nil {
		return "", fmt.Errorf("no home directory: %w", err)
	}
	return filepath.Join(home, ".tandem", "ssh_config"), nil
}

// File is tandem's ssh config at Path.
type File struct{ Path string }

// Edit rewrites the file under an exclusive lock (Path + ".lock"): edit
// gets the entries and returns the new ones. The file is replaced
// atomically, mode 0600, its directory made 0700 when missing.
func (f File) Edit(edit func(entries []string) []string) error {
	if err := os.MkdirAll(filepath.Dir(f.Path), 0o700); err != nil {
		return err
	}
	lock, err := os.OpenFile(f.Path+".lock", os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return err
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return fmt.Errorf("lock %s: %w", f.Path, err)
	}
	old, err := os.ReadFile(f.Path)
	if err != nil && !os.IsNotExist(err) {
		return err
	}
	var b bytes.Buffer
	b.WriteString(header)
	for _, e := range edit(parse(old)) {
		b.WriteString(strings.TrimRight(e, "\n") + "\n\n")
	}
	if err := atomicfile.WriteBytes(f.Path, b.Bytes(), atomicfile.Options{Perm: 0o600, UID: -1}); err != nil {
		return err
	}
	f.prunePins(b.Bytes())
	return nil
}

// PinDir holds one known_hosts file per task (its runner's host keys under
// the task's alias), beside the config.
func (f File) PinDir() string { return filepath.Join(filepath.Dir(f.Path), "known_hosts.d") }

// WritePins writes the known_hosts file of taskID into dir: each key under
// alias (ssh's HostKeyAlias), so ssh checks the task's real host key
// whatever port or jump reaches it. It returns the file's path.
func WritePins(dir, taskID, alias string, keys []string) (string, error) {
	if err := ident.TaskID(taskID); err != nil {
		return "", err
	}
	if err := ident.TaskName(alias); err != nil {
		return "", err
	}
	var b strings.Builder
	for _, k := range keys {
		if strings.ContainsAny(k, "\n\r") || len(strings.Fields(k)) != 2 {
			return "", fmt.Errorf("host key %q: not one key", k)
		}
		b.WriteString(alias + " " + k + "\n")
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	path := filepath.Join(dir, taskID)
	return path, atomicfile.WriteBytes(path, []byte(b.String()), atomicfile.Options{Perm: 0o600, UID: -1})
}

// prunePins drops the known_hosts files of tasks that have no entry.
func (f File) prunePins(content []byte) {
	ents, err := os.ReadDir(f.PinDir())
	if err != nil {
		return
	}
	keep := map[string]bool{}
	for _, e := range parse(content) {
		id, _ := EntryTask(e)
		keep[id] = true
	}
	for _, e := range ents {
		if !keep[e.Name()] && ident.TaskID(e.Name()) == nil {
			_ = os.Remove(filepath.Join(f.PinDir(), e.Name()))
		}
	}
}

// parse returns the entries of a file's content: the blocks that start
// with a marker line.
func parse(content []byte) []string {
	var entries []string
	for _, block := range strings.SplitAfter(string(content), "\n\n") {
		if strings.HasPrefix(block, "# tandem task ") {
			entries = append(entries, strings.TrimRight(block, "\n")+"\n")
		}
	}
	return entries
}

// Marker is the line that opens a task's entry.
func Marker(taskID, shim string) string { return "# tandem task " + taskID + " shim " + shim }

// EntryTask returns the task id and shim named by an entry's marker.
func EntryTask(entry string) (id, shim string) {
	line, _, _ := strings.Cut(entry, "\n")
	f := strings.Fields(line) // # tandem task ID shim ADDR
	if len(f) >= 6 {
		return f[3], f[5]
	}
	return "", ""
}

// Put adds entry for taskID, replacing the task's earlier entry and any
// entry for the same Host alias.
func (f File) Put(taskID, alias, entry string) error {
	return f.Edit(func(entries []string) []string {
		out := []string{entry}
		for _, e := range entries {
			if id, _ := EntryTask(e); id != taskID && !strings.Contains(e, "\nHost "+alias+"\n") {
				out = append(out, e)
			}
		}
		return out
	})
}

// Forget drops the task's entry; a missing file is left missing.
func (f File) Forget(taskID string) error {
	if _, err := os.Stat(f.Path); err != nil {
		return nil
	}
	return f.Edit(func(entries []string) []string {
		var out []string
		for _, e := range entries {
			if id, _ := EntryTask(e); id != taskID {
				out = append(out, e)
			}
		}
		return out
	})
}

// Tasks returns the ids of the tasks of shim that have an entry.
func (f File) Tasks(shim string) (map[string]bool, error) {
	b, err := os.ReadFile(f.Path)
	if err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	ids := map[string]bool{}
	for _, e := range parse(b) {
		if id, s := EntryTask(e); s == shim && id != "" {
			ids[id] = true
		}
	}
	return ids, nil
}

// ReplaceShim sets the entries of one shim's tasks to fresh, keeping
// other shims' entries.
func (f File) ReplaceShim(shim string, fresh []string) error {
	return f.Edit(func(entries []string) []string {
		out := append([]string(nil), fresh...)
		for _, e := range entries {
			if _, s := EntryTask(e); s != shim {
				out = append(out, e)
			}
		}
		return out
	})
}

// Included reports whether userConfig (~/.ssh/config) includes path.
func Included(userConfig, path string) bool {
	b, err := os.ReadFile(userConfig)
	return err == nil && bytes.Contains(b, []byte("Include "+path))
}

// Install puts "Include path" first in userConfig (an Include after a Host
// block would belong to that block), once; the file keeps its mode.
func Install(userConfig, path string) error {
	if Included(userConfig, path) {
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(userConfig), 0o700); err != nil {
		return err
	}
	old, err := os.ReadFile(userConfig)
	if err != nil && !os.IsNotExist(err) {
		return err
	}
	mode := os.FileMode(0o600)
	if fi, err := os.Stat(userConfig); err == nil {
		mode = fi.Mode().Perm()
	}
	return atomicfile.WriteBytes(userConfig, append([]byte("Include "+path+"\n\n"), old...), atomicfile.Options{Perm: mode, UID: -1})
}
