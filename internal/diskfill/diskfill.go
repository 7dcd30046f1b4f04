// Package diskfill fills a test filesystem to its last block, as a
// neighbour that used all the space would (unit and e2e tests share it).
package diskfill

import (
	"errors"
	"os"
	"syscall"
	"testing"
)

// Full writes file until its filesystem refuses even a single byte: ever
// smaller writes, so the last partial blocks go too (a 64 KiB write
// refused still leaves up to 64 KiB). A filesystem already too full to
// create the file is full.
func Full(t testing.TB, file string) {
	t.Helper()
	// Space a filesystem still owes back (a loop-mounted runner dir's
	// discards at its next commit) is given back first, and again after the
	// first pass, which then tops up: the disk stays full after Full.
	syscall.Sync()
	f, err := os.Create(file)
	if err != nil {
		if noSpace(err) {
			return
		}
		t.Fatal(err)
	}
	defer f.Close()
	for range 2 {
		for size := 1 << 20; size > 0; size /= 4 {
			buf := make([]byte, size)
			for {
				if _, err := f.Write(buf); err != nil {
					if !noSpace(err) {
						t.Fatal(err)
					}
					break
				}
			}
		}
		_ = f.Sync()
		syscall.Sync()
	}
}

func noSpace(err error) bool {
	return errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT)
}
