// Package repo prepares a job's code and files: extracting uploaded tars
// (code blobs and file archives) without ever writing outside their
// destination, and cloning remote repositories with an uploaded diff on top.
package repo

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
)

// ErrUnsafePath marks an archive entry that would land outside its destination.
var ErrUnsafePath = errors.New("unsafe path in archive")

// ErrTooBig marks an archive past the extraction limits.
var ErrTooBig = errors.New("archive too big")

// Owner is who extracted files belong to; a negative UID leaves them as is.
type Owner struct{ UID, GID int }

// Limits bound one extraction: the bytes written in all and the number of
// entries. Sparse entries are refused outright: a few KiB of sparse map
// describe any number of bytes.
type Limits struct {
	MaxBytes   int64
	MaxEntries int
}

// DefaultLimits: 8 GiB and 1,000,000 entries per archive, far above any
// code tree or files: mount, and finite.
var DefaultLimits = Limits{MaxBytes: 8 << 30, MaxEntries: 1_000_000}

// budget counts an extraction against its Limits.
type budget struct {
	lim     Limits
	bytes   int64
	entries int
}

func (b *budget) take(hdr *tar.Header) error {
	if hdr.Typeflag == tar.TypeGNUSparse {
		return fmt.Errorf("%w: %q is a sparse file; sparse entries are not extracted", ErrUnsafePath, hdr.Name)
	}
	for k := range hdr.PAXRecords {
		if strings.HasPrefix(k, "GNU.sparse.") {
			return fmt.Errorf("%w: %q is a sparse file; sparse entries are not extracted", ErrUnsafePath, hdr.Name)
		}
	}
	b.entries++
	if b.entries > b.lim.MaxEntries {
		return fmt.Errorf("%w: more than %d entries", ErrTooBig, b.lim.MaxEntries)
	}
	if hdr.Typeflag == tar.TypeReg {
		if hdr.Size < 0 || hdr.Size > b.lim.MaxBytes-b.bytes {
			return fmt.Errorf("%w: %q would take the archive past %d bytes", ErrTooBig, hdr.Name, b.lim.MaxBytes)
		}
		b.bytes += hdr.Size
	}
	return nil
}

// cleanEntry validates a tar entry name and returns it relative and clean.
func cleanEntry(name string) (string, error) {
	if name == "" {
		return "", fmt.Errorf("%w: empty name", ErrUnsafePath)
	}
	if strings.HasPrefix(name, "/") || filepath.IsAbs(name) {
		return "", fmt.Errorf("%w: %q is absolute", ErrUnsafePath, name)
	}
	for _, part := range strings.Split(name, "/") {
		if part == ".." {
			return "", fmt.Errorf("%w: %q climbs out with a \"..\" component", ErrUnsafePath, name)
		}
	}
	c := path.Clean(name)
	if c == "." {
		return ".", nil
	}
	return c, nil
}

// ExtractTar extracts an uncompressed tar into dir (created if needed).
// Every write goes through an os.Root on dir, so symlinks in the archive or
// already in dir cannot redirect a write outside it.
func ExtractTar(r io.Reader, dir string, owner Owner) error {
	return extractTar(r, dir, owner, DefaultLimits)
}

func extractTar(r io.Reader, dir string, owner Owner, lim Limits) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("extract: %w", err)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return fmt.Errorf("extract: %w", err)
	}
	defer root.Close()
	return extract(tar.NewReader(r), root, owner, lim)
}

// ExtractArchive extracts a `files:` archive to dest. The client archives a
// file or directory with names relative to its parent, so the first path
// component of every entry is the source's basename: it is replaced by
// dest's, in entry names and hard link targets alike. dest is removed first.
func ExtractArchive(r io.Reader, dest string, owner Owner) error {
	return extractArchive(r, dest, owner, DefaultLimits)
}

func extractArchive(r io.Reader, dest string, owner Owner, lim Limits) error {
	dest = filepath.Clean(dest)
	if !filepath.IsAbs(dest) {
		return fmt.Errorf("archive destination %q must be absolute", dest)
	}
	parent := filepath.Dir(dest)
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return fmt.Errorf("extract: %w", err)
	}
	if err := os.RemoveAll(dest); err != nil {
		return fmt.Errorf("extract: remove %s: %w", dest, err)
	}
	tr := tar.NewReader(r)
	// The first entry tells whether the archive is one file or a tree.
	var roots []*os.Root
	defer func() {
		for _, rt := range roots {
			rt.Close()
		}
	}()
	prootDir, err := os.OpenRoot(parent)
	if err != nil {
		return fmt.Errorf("extract: %w", err)
	}
	roots = append(roots, prootDir)
	var destRoot *os.Root
	base := filepath.Base(dest)
	return eachEntry(tr, lim, func(hdr *tar.Header, name string) error {
		_, rest, _ := strings.Cut(name, "/")
		if hdr.Typeflag == tar.TypeLink {
			target, err := cleanEntry(hdr.Linkname)
			if err != nil {
				return err
			}
			_, ltail, _ := strings.Cut(target, "/")
			if ltail == "" || ltail == "." || rest == "" {
				return fmt.Errorf("%w: hard link %q -> %q does not stay inside the archived tree", ErrUnsafePath, hdr.Name, hdr.Linkname)
			}
			hdr.Linkname = ltail
		}
		if rest == "" || rest == "." {
			// The source itself: a single file, or the top directory.
			if hdr.Typeflag == tar.TypeDir {
				if err := prootDir.MkdirAll(base, 0o755); err != nil {
					return fmt.Errorf("extract: %w", err)
				}
				chown(prootDir, base, owner)
				return nil
			}
			return writeEntry(prootDir, base, hdr, tr, owner)
		}
		if destRoot == nil {
			if err := prootDir.MkdirAll(base, 0o755); err != nil {
				return fmt.Errorf("extract: %w", err)
			}
			chown(prootDir, base, owner)
			var err error
			if destRoot, err = prootDir.OpenRoot(base); err != nil {
				return fmt.Errorf("extract: %w", err)
			}
			roots = append(roots, destRoot)
		}
		return writeEntry(destRoot, rest, hdr, tr, owner)
	})
}

func extract(tr *tar.Reader, root *os.Root, owner Owner, lim Limits) error {
	return eachEntry(tr, lim, func(hdr *tar.Header, name string) error {
		if name == "." {
			return nil
		}
		return writeEntry(root, name, hdr, tr, owner)
	})
}

// eachEntry calls fn for every entry with its validated, cleaned name; an
// unsafe name or an entry past the limits stops the walk.
func eachEntry(tr *tar.Reader, lim Limits, fn func(hdr *tar.Header, name string) error) error {
	b := budget{lim: lim}
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("extract: read archive: %w", err)
		}
		name, err := cleanEntry(hdr.Name)
		if err != nil {
			return err
		}
		if err := b.take(hdr); err != nil {
			return err
		}
		if err := fn(hdr, name); err != nil {
			return err
		}
	}
}

func writeEntry(root *os.Root, name string, hdr *tar.Header, r io.Reader, owner Owner) error {
	mode := fs.FileMode(hdr.Mode).Perm()
	if dir := path.Dir(name); dir != "." {
		if err := root.MkdirAll(dir, 0o755); err != nil {
			return unsafeOr(name, err)
		}
	}
	switch hdr.Typeflag {
	case tar.TypeDir:
		if err := root.MkdirAll(name, 0o755); err != nil {
			return unsafeOr(name, err)
		}
		_ = root.Chmod(name, mode|0o700)
	case tar.TypeReg: // the reader already maps legacy TypeRegA here
		_ = root.Remove(name) // replace, never write through an existing link
		f, err := root.OpenFile(name, os.O_CREATE|os.O_EXCL|os.O_WRONLY, mode)
		if err != nil {
			return unsafeOr(name, err)
		}
		_, err = io.Copy(f, r)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("extract %s: %w", name, err)
		}
		_ = root.Chmod(name, mode)
	case tar.TypeSymlink:
		_ = root.Remove(name)
		if err := root.Symlink(hdr.Linkname, name); err != nil {
			return unsafeOr(name, err)
		}
	case tar.TypeLink:
		target, err := cleanEntry(hdr.Linkname)
		if err != nil {
			return err
		}
		_ = root.Remove(name)
		if err := root.Link(target, name); err != nil {
			return unsafeOr(name, err)
		}
	default:
		return nil // devices, fifos: not part of code or files
	}
	chown(root, name, owner)
	return nil
}

func chown(root *os.Root, name string, owner Owner) {
	if owner.UID >= 0 {
		_ = root.Lchown(name, owner.UID, owner.GID)
	}
}

func unsafeOr(name string, err error) error {
	if strings.Contains(err.Error(), "escapes") {
		return fmt.Errorf("%w: %q leads outside the destination", ErrUnsafePath, name)
	}
	return fmt.Errorf("extract %s: %w", name, err)
}
