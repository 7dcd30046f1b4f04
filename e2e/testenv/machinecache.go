package testenv

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// machineCache returns the directory name under the temp dir, made once
// per machine: under a lock beside it (test processes run in parallel),
// fill makes its content in a fresh directory that then takes its place,
// so a fill that failed half-way leaves nothing that looks made.
func machineCache(t testing.TB, name string, fill func(dir string)) string {
	t.Helper()
	return machineCacheIn(t, os.TempDir(), name, fill)
}

// machineCacheIn is machineCache under base instead of the temp dir.
func machineCacheIn(t testing.TB, base, name string, fill func(dir string)) string {
	t.Helper()
	if err := os.MkdirAll(base, 0o755); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(base, name)
	f, err := os.OpenFile(dir+".lock", os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatalf("%s lock: %v", name, err)
	}
	defer f.Close()
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatalf("%s lock: %v", name, err)
	}
	defer func() { _ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN) }()
	if _, err := os.Stat(dir); err == nil {
		return dir
	}
	tmp, err := os.MkdirTemp(base, name+".fill-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(tmp)
	fill(tmp)
	if err := os.Chmod(tmp, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, dir); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return dir
}
