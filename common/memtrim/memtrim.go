// Package memtrim gives back the pages of the program's own executable that
// start-up touched and serving does not need.
//
// A Go program's start runs every package's init, spread over the whole
// binary, and on kernels that keep files in large folios (ext4 on 6.16+) each
// touch maps a whole folio, up to 2 MiB: an idle shim had 16.9 MB of its 17
// MB binary resident, five times its private memory. Those are clean pages of
// the file: dropping them loses nothing, and whatever is used again is read
// back in on its next touch.
package memtrim

// Mapping is one read-only mapping of the executable.
type Mapping struct {
	Start, End uintptr
	Perms      string
	RSS        int64 // bytes resident
}

// Result says what a release did.
type Result struct {
	Mappings int   // mappings released
	Before   int64 // resident bytes of the executable before
	After    int64 // and right after
}
