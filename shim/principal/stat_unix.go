//go:build unix

package principal

import (
	"fmt"
	"os"
	"syscall"
)

// statGroup returns the group and permission bits of path (following a
// symlink, as a client connecting to the socket does).
func statGroup(path string) (uint32, os.FileMode, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return 0, 0, err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, 0, fmt.Errorf("stat %s: no owner", path)
	}
	return st.Gid, fi.Mode().Perm(), nil
}
