package ctl

// The code a run uploads: a local directory, sent to the runner as an
// uncompressed tar.

import (
	"archive/tar"
	"cmp"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/tandem-run/tandem/api"
)

// isCode says whether an entry of this mode travels with the code: files,
// directories and symbolic links do. Sockets (a git fsmonitor's, an
// editor server's), devices and named pipes are not code, the runner would
// not make them, and tar cannot carry a socket at all: they are left out,
// as docker build's context and rsync leave them.
func isCode(m fs.FileMode) bool { return m.IsRegular() || m.IsDir() || m&fs.ModeSymlink != 0 }

// codeScan is what a code directory sends.
type codeScan struct {
	size    int64       // the archive's size, headers included (near enough)
	biggest []codeEntry // its largest files, largest first (at most 3)
	skipped []string    // entries left out, relative to the directory
}

type codeEntry struct {
	name string
	size int64
}

// scanCode walks dir as tarDir will, without reading a file.
func scanCode(dir string) (codeScan, error) {
	var s codeScan
	fi, err := os.Stat(dir)
	if err != nil {
		return s, err
	}
	if !fi.IsDir() {
		return s, fmt.Errorf("%s is not a directory", dir)
	}
	err = walkCode(dir, func(rel string, fi fs.FileInfo) error {
		s.size += tarBlock // its header
		if fi.Mode().IsRegular() {
			s.size += (fi.Size() + tarBlock - 1) / tarBlock * tarBlock
			s.biggest = append(s.biggest, codeEntry{rel, fi.Size()})
			slices.SortFunc(s.biggest, func(a, b codeEntry) int { return cmp.Compare(b.size, a.size) })
			s.biggest = s.biggest[:min(len(s.biggest), 3)]
		}
		return nil
	}, func(rel string) { s.skipped = append(s.skipped, rel) })
	s.size += 2 * tarBlock // the end
	return s, err
}

const tarBlock = 512

// checkCode refuses, before anything is made, a code directory that the
// runner would refuse (over o.CodeLimit: the runner's own limit, by
// default api.MaxUpload) or that is not one, and says which entries are
// left out (to tell).
func checkCode(o RunOptions, tell say) error {
	if o.CodeDir == "" {
		return nil
	}
	s, err := scanCode(o.CodeDir)
	if err != nil {
		return fmt.Errorf("code: %w", err)
	}
	limit := cmp.Or(o.CodeLimit, api.MaxUpload)
	if limit > 0 && s.size > limit {
		var big []string
		for _, e := range s.biggest {
			big = append(big, fmt.Sprintf("%s (%s)", e.name, BytesText(uint64(e.size))))
		}
		return fmt.Errorf("code: %s is %s as an archive; a runner takes at most %s unless its --max-upload-bytes was raised (then pass --code-limit) (largest files: %s)",
			o.CodeDir, BytesText(uint64(s.size)), BytesText(uint64(limit)), strings.Join(big, ", "))
	}
	if n := len(s.skipped); n > 0 {
		shown := s.skipped[:min(n, 3)]
		more := ""
		if n > len(shown) {
			more = fmt.Sprintf(" and %d more", n-len(shown))
		}
		tell.status("code: left out what is not a file, directory or link (sockets, devices, named pipes): %s%s",
			strings.Join(shown, ", "), more)
	}
	return nil
}

// walkCode calls each for every entry under dir that travels with the
// code (relative name, its own info: links are not followed), in walk
// order, and skip for each one left out.
func walkCode(dir string, each func(rel string, fi fs.FileInfo) error, skip func(rel string)) error {
	return filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil || rel == "." {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		if !isCode(fi.Mode()) {
			if skip != nil {
				skip(filepath.ToSlash(rel))
			}
			return nil
		}
		return each(filepath.ToSlash(rel), fi)
	})
}

// tarDir writes dir as an uncompressed tar with paths relative to it. A
// file is sent as long as it was when its header was written: one that
// grows meanwhile (a log) is cut there; one that shrinks fails the upload.
func tarDir(dir string, w io.Writer) error {
	tw := tar.NewWriter(w)
	err := walkCode(dir, func(rel string, fi fs.FileInfo) error {
		p := filepath.Join(dir, filepath.FromSlash(rel))
		link := ""
		if fi.Mode()&fs.ModeSymlink != 0 {
			var err error
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		hdr, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return fmt.Errorf("%s: %w", rel, err)
		}
		hdr.Name = rel
		if fi.IsDir() {
			hdr.Name += "/"
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if !fi.Mode().IsRegular() {
			return nil
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		defer f.Close()
		if _, err := io.CopyN(tw, f, hdr.Size); err != nil {
			if errors.Is(err, io.EOF) {
				return fmt.Errorf("%s shrank while it was sent (%d bytes when it was listed)", rel, hdr.Size)
			}
			return err
		}
		return nil
	}, nil)
	if err != nil {
		return err
	}
	return tw.Close()
}

// BytesText renders a size as docker stats does: 1.5GiB, 300MiB, 12KiB.
func BytesText(n uint64) string {
	units := []struct {
		s string
		v uint64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}}
	for _, u := range units {
		if n >= u.v {
			return fmt.Sprintf("%.4g%s", float64(n)/float64(u.v), u.s)
		}
	}
	return fmt.Sprintf("%dB", n)
}
