package memtrim

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Release drops this process's pages of its own executable that are
// read-only and unmodified, stops the kernel from mapping them in huge
// pages again, and asks it to drop them from the page cache, so that what
// is used again comes back in small pieces.
func Release() (Result, error) {
	var r Result
	f, err := os.Open("/proc/self/exe")
	if err != nil {
		return r, fmt.Errorf("memtrim: %w", err)
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return r, fmt.Errorf("memtrim: stat executable: %w", err)
	}
	id := fileID{major: unix.Major(st.Dev), minor: unix.Minor(st.Dev), inode: st.Ino}
	data, err := os.ReadFile("/proc/self/smaps")
	if err != nil {
		return r, fmt.Errorf("memtrim: %w", err)
	}
	maps, err := readOnlyMappings(data, id)
	if err != nil {
		return r, fmt.Errorf("memtrim: %w", err)
	}
	for _, m := range maps {
		r.Before += m.RSS
	}
	r.Mappings = len(maps)
	if len(maps) == 0 {
		return r, nil
	}
	if err := release(maps, int(f.Fd())); err != nil {
		return r, fmt.Errorf("memtrim: %w", err)
	}
	if data, err := os.ReadFile("/proc/self/smaps"); err == nil {
		after, _ := readOnlyMappings(data, id)
		for _, m := range after {
			r.After += m.RSS
		}
	}
	return r, nil
}

// fileID names a file as /proc/*/maps does: device and inode.
type fileID struct {
	major, minor uint32
	inode        uint64
}

// readOnlyMappings returns the mappings of the file id that are never
// written: no w in their permissions and not one anonymous (copied on
// write) page, which rules out the relocated (RELRO) page. Those hold only
// the file's own bytes.
func readOnlyMappings(smaps []byte, id fileID) ([]Mapping, error) {
	var out []Mapping
	var cur *Mapping
	var anon int64
	flush := func() {
		if cur != nil && anon == 0 {
			out = append(out, *cur)
		}
		cur, anon = nil, 0
	}
	sc := bufio.NewScanner(bytes.NewReader(smaps))
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		if !strings.HasSuffix(f[0], ":") { // a mapping's header line
			flush()
			if len(f) < 5 || strings.Contains(f[1], "w") || !sameFile(f[3], f[4], id) {
				continue
			}
			m, err := parseRange(f[0])
			if err != nil {
				return nil, err
			}
			m.Perms = f[1]
			cur = &m
			continue
		}
		if cur == nil || len(f) < 2 {
			continue
		}
		n, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			continue
		}
		switch f[0] {
		case "Rss:":
			cur.RSS = n << 10
		case "Anonymous:":
			anon = n
		}
	}
	flush()
	return out, sc.Err()
}

func parseRange(s string) (Mapping, error) {
	lo, hi, ok := strings.Cut(s, "-")
	start, err1 := strconv.ParseUint(lo, 16, 64)
	end, err2 := strconv.ParseUint(hi, 16, 64)
	if !ok || err1 != nil || err2 != nil || end <= start {
		return Mapping{}, fmt.Errorf("smaps: bad range %q", s)
	}
	return Mapping{Start: uintptr(start), End: uintptr(end)}, nil
}

// sameFile compares a maps line's "fe:01" device and inode with id.
func sameFile(dev, inode string, id fileID) bool {
	maj, min, ok := strings.Cut(dev, ":")
	a, err1 := strconv.ParseUint(maj, 16, 32)
	b, err2 := strconv.ParseUint(min, 16, 32)
	ino, err3 := strconv.ParseUint(inode, 10, 64)
	return ok && err1 == nil && err2 == nil && err3 == nil && ino != 0 &&
		uint32(a) == id.major && uint32(b) == id.minor && ino == id.inode
}
