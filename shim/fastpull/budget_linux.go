package fastpull

import "golang.org/x/sys/unix"

// tempBudget is what one pull may write under dir: half of what is free
// there above a floor of a tenth of the filesystem (Docker's own copy of
// the layers needs the other half).
func tempBudget(dir string) int64 {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0
	}
	free := int64(st.Bavail) * st.Bsize
	floor := int64(st.Blocks) * st.Bsize / 10
	return max(0, (free-floor)/2)
}
