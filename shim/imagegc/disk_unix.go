//go:build unix

package imagegc

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// Statfs reads a filesystem's usage from the kernel. Free is what an
// unprivileged writer may still take (f_bavail), as df counts it: the
// blocks kept for root do not save a pull from a full disk.
type Statfs struct{}

// Usage implements Disk.
func (Statfs) Usage(path string) (Usage, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return Usage{}, fmt.Errorf("statfs %s: %w", path, err)
	}
	bs := uint64(st.Bsize)
	return Usage{Total: uint64(st.Blocks) * bs, Free: uint64(st.Bavail) * bs}, nil
}
