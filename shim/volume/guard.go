package volume

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// The guard is what keeps "never format data" true by construction. A
// device is formatted only when every check agrees it holds nothing:
//
//   - blkid finds no signature (probe, re-confirmed);
//   - its first and last MiB read as zeros (fresh EBS volumes and GCP disks
//     do; a raw database, a BIOS-boot partition or a damaged superblock do
//     not);
//   - it is not in use (below).
//
// A device is in use, and is neither formatted nor mounted, when it or any
// of its partitions (or, for a partition, its disk) is mounted anywhere, has
// holders (LVM, RAID, dm-crypt), holds the root file system, or cannot be
// opened exclusively (the kernel's own claim check: O_EXCL on a block
// device fails with EBUSY while anything has it mounted or claimed).

// blankWindow is how much of each end of a device must read as zeros.
const blankWindow = 1 << 20

// devNum is a block device number, "major:minor" as in mountinfo and sysfs.
type devNum struct{ major, minor uint32 }

func (d devNum) String() string { return fmt.Sprintf("%d:%d", d.major, d.minor) }

func deviceNumber(dev string) (devNum, error) {
	var st unix.Stat_t
	if err := unix.Stat(dev, &st); err != nil {
		return devNum{}, fmt.Errorf("stat %s: %w", dev, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return devNum{}, fmt.Errorf("%s is not a block device", dev)
	}
	return devNum{unix.Major(uint64(st.Rdev)), unix.Minor(uint64(st.Rdev))}, nil
}

// mountEntry is one line of mountinfo: the device and where it is mounted.
type mountEntry struct {
	dev    devNum
	target string
	fstype string
}

// readMountinfo parses a mountinfo file (/proc/self/mountinfo).
func readMountinfo(path string) ([]mountEntry, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	var out []mountEntry
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 7 {
			continue
		}
		d, ok := parseDevNum(f[2])
		if !ok {
			continue
		}
		e := mountEntry{dev: d, target: unescapeMount(f[4])}
		for i := 6; i < len(f)-1; i++ {
			if f[i] == "-" {
				e.fstype = f[i+1]
				break
			}
		}
		out = append(out, e)
	}
	return out, sc.Err()
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// family is the device, its partitions and, for a partition, its disk and
// the disk's other partitions: everything whose use makes dev unsafe.
func (m *Manager) family(d devNum) []devNum {
	sys := m.sysRoot()
	out := []devNum{d}
	base, err := filepath.EvalSymlinks(filepath.Join(sys, "dev", "block", d.String()))
	if err != nil {
		return out
	}
	disk := base
	if _, err := os.Stat(filepath.Join(base, "partition")); err == nil {
		disk = filepath.Dir(base) // a partition's sysfs dir sits in its disk's
		if n, ok := readDevFile(filepath.Join(disk, "dev")); ok {
			out = append(out, n)
		}
	}
	entries, _ := os.ReadDir(disk)
	for _, e := range entries {
		p := filepath.Join(disk, e.Name())
		if _, err := os.Stat(filepath.Join(p, "partition")); err != nil {
			continue
		}
		if n, ok := readDevFile(filepath.Join(p, "dev")); ok && n != d {
			out = append(out, n)
		}
	}
	return out
}

func readDevFile(path string) (devNum, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return devNum{}, false
	}
	return parseDevNum(strings.TrimSpace(string(b)))
}

// parseDevNum reads "major:minor" (mountinfo's third field, sysfs's dev).
func parseDevNum(s string) (devNum, bool) {
	maj, min, ok := strings.Cut(s, ":")
	a, err1 := strconv.ParseUint(maj, 10, 32)
	c, err2 := strconv.ParseUint(min, 10, 32)
	if !ok || err1 != nil || err2 != nil {
		return devNum{}, false
	}
	return devNum{uint32(a), uint32(c)}, true
}

func (m *Manager) sysRoot() string {
	if m.SysRoot != "" {
		return m.SysRoot
	}
	return "/sys"
}

func (m *Manager) mountinfoPath() string {
	if m.Mountinfo != "" {
		return m.Mountinfo
	}
	return "/proc/self/mountinfo"
}

// checkNotInUse refuses a device that anything else is using.
func (m *Manager) checkNotInUse(dev string) error {
	d, err := deviceNumber(dev)
	if err != nil {
		return err
	}
	fam := m.family(d)
	mounts, err := readMountinfo(m.mountinfoPath())
	if err != nil {
		return err
	}
	for _, mt := range mounts {
		for _, f := range fam {
			if mt.dev != f {
				continue
			}
			if mt.target == "/" {
				return fmt.Errorf("device %s (%s) holds the root file system; refusing to use it as a volume", dev, f)
			}
			return fmt.Errorf("device %s (%s) is in use: mounted at %s; refusing to use it as a volume", dev, f, mt.target)
		}
	}
	for _, f := range fam {
		holders, _ := os.ReadDir(filepath.Join(m.sysRoot(), "dev", "block", f.String(), "holders"))
		if len(holders) > 0 {
			return fmt.Errorf("device %s (%s) is in use by %s (LVM, RAID or dm); refusing to use it as a volume", dev, f, holders[0].Name())
		}
	}
	fd, err := unix.Open(dev, unix.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("device %s is in use (the kernel refuses an exclusive open); refusing to use it as a volume", dev)
	}
	if err != nil {
		return fmt.Errorf("open %s: %w", dev, err)
	}
	unix.Close(fd)
	return nil
}

// checkZeroEnds refuses a device whose first or last MiB holds any
// non-zero byte: data that blkid does not recognise is still data.
func checkZeroEnds(dev string) error {
	f, err := os.Open(dev)
	if err != nil {
		return fmt.Errorf("open %s: %w", dev, err)
	}
	defer f.Close()
	size, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		return fmt.Errorf("size of %s: %w", dev, err)
	}
	buf := make([]byte, blankWindow)
	for _, off := range []int64{0, max(size-blankWindow, 0)} {
		n, err := f.ReadAt(buf[:min(int64(blankWindow), size)], off)
		if err != nil && !errors.Is(err, io.EOF) {
			return fmt.Errorf("read %s: %w", dev, err)
		}
		for i, c := range buf[:n] {
			if c != 0 {
				return fmt.Errorf("device %s has data but no file system we recognise (non-zero byte at offset %d): refusing to format it", dev, off+int64(i))
			}
		}
	}
	return nil
}

// mountedDevice returns the device mounted exactly at target, if any.
func (m *Manager) mountedDevice(target string) (mountEntry, bool, error) {
	mounts, err := readMountinfo(m.mountinfoPath())
	if err != nil {
		return mountEntry{}, false, err
	}
	var found mountEntry
	ok := false
	for _, mt := range mounts {
		if mt.target == target {
			found, ok = mt, true // the last one is on top
		}
	}
	return found, ok, nil
}
