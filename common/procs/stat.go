package procs

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// StatFields reads the stat file of a process or thread (dir/stat, dir
// being /proc/<pid> or /proc/<pid>/task/<tid>) and returns its fields from
// the state on: field n of proc(5) is at index n-3. The command name before
// them is in parentheses and may itself hold spaces and parentheses, so the
// fields count from after the last ')'.
func StatFields(dir string) ([]string, error) {
	path := filepath.Join(dir, "stat")
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return nil, fmt.Errorf("%s: no command name", path)
	}
	return strings.Fields(s[i+1:]), nil
}
