package memtrim

import (
	"os"
	"testing"
)

const smapsFixture = `00400000-00411000 r--p 00000000 fe:00 9986915                            /usr/local/bin/dstack-shim
Size:                 68 kB
Rss:                  68 kB
Anonymous:             0 kB
VmFlags: rd mr mw me dw sd
00411000-00b67000 r-xp 00011000 fe:00 9986915                            /usr/local/bin/dstack-shim
Size:               7512 kB
Rss:                7512 kB
Anonymous:             0 kB
VmFlags: rd ex mr mw me dw sd
01401000-01402000 r--p 01000000 fe:00 9986915                            /usr/local/bin/dstack-shim
Size:                  4 kB
Rss:                   4 kB
Anonymous:             4 kB
VmFlags: rd mr mw me dw ac sd
01402000-01491000 rw-p 01001000 fe:00 9986915                            /usr/local/bin/dstack-shim
Size:                572 kB
Rss:                 512 kB
Anonymous:           100 kB
VmFlags: rd wr mr mw me dw ac sd
7f0000000000-7f0000100000 r-xp 00000000 fe:00 12345                            /usr/lib/x86_64-linux-gnu/libc.so.6
Size:               1024 kB
Rss:                1000 kB
Anonymous:             0 kB
VmFlags: rd ex mr mw me sd
7f0000200000-7f0000300000 r-xp 00000000 fe:01 9986915                            /other/device/same/inode
Size:               1024 kB
Rss:                1000 kB
Anonymous:             0 kB
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
Size:                132 kB
Rss:                  12 kB
Anonymous:            12 kB
`

func TestReadOnlyMappings(t *testing.T) {
	got, err := readOnlyMappings([]byte(smapsFixture), fileID{major: 0xfe, minor: 0, inode: 9986915})
	if err != nil {
		t.Fatal(err)
	}
	// The header and the text: not the RELRO page (copied on write), not
	// the data segment, not libc, not the same inode on another device.
	want := []Mapping{
		{Start: 0x400000, End: 0x411000, Perms: "r--p", RSS: 68 << 10},
		{Start: 0x411000, End: 0xb67000, Perms: "r-xp", RSS: 7512 << 10},
	}
	if len(got) != len(want) {
		t.Fatalf("got %+v", got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("mapping %d: %+v, want %+v", i, got[i], want[i])
		}
	}
	for _, bad := range []string{"zz-00411000 r-xp 0 fe:00 9986915 /x\n", "00411000-00400000 r-xp 0 fe:00 9986915 /x\n"} {
		if _, err := readOnlyMappings([]byte(bad), fileID{major: 0xfe, inode: 9986915}); err == nil {
			t.Errorf("no error for %q", bad)
		}
	}
	if m, err := readOnlyMappings(nil, fileID{}); err != nil || len(m) != 0 {
		t.Errorf("empty smaps: %v %v", m, err)
	}
}

// TestRelease runs the real release on this test binary: its read-only
// pages go, and the program goes on running code and reading data from
// them.
func TestRelease(t *testing.T) {
	if _, err := os.Stat("/proc/self/smaps"); err != nil {
		t.Skip("no /proc/self/smaps")
	}
	r, err := Release()
	if err != nil {
		t.Fatal(err)
	}
	if r.Mappings < 2 || r.Before <= 0 {
		t.Fatalf("found %d mappings, %d bytes resident", r.Mappings, r.Before)
	}
	if r.After >= r.Before {
		t.Fatalf("resident before %d, after %d", r.Before, r.After)
	}
	// Code and read-only data still work, and a second release is harmless.
	if _, err := readOnlyMappings([]byte(smapsFixture), fileID{major: 0xfe, inode: 9986915}); err != nil {
		t.Fatal(err)
	}
	if _, err := Release(); err != nil {
		t.Fatal(err)
	}
	t.Logf("executable resident: %d KiB before, %d KiB after", r.Before>>10, r.After>>10)
}
