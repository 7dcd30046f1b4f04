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

// Owner is who extracted files belong to; a negative UID leaves them as is.
type Owner struct{ UID, GID int }

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
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("extract: %w", err)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return fmt.Errorf("extract: %w", err)
	}
	defer root.Close()
	return extract(tar.NewReader(r), root, owner)
}

// ExtractArchive extracts a `files:` archive to dest. The client archives a
// file or directory with names relative to its parent, so the first path
// component of every entry is the source's basename: it is replaced by
// dest's. dest is removed first.
func ExtractArchive(r io.Reader, dest string, owner Owner) error {
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
	return eachEntry(tr, func(hdr *tar.Header, name string) error {
		_, rest, _ := strings.Cut(name, "/")
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

func extract(tr *tar.Reader, root *os.Root, owner Owner) error {
	return eachEntry(tr, func(hdr *tar.Header, name string) error {
		if name == "." {
			return nil
		}
		return writeEntry(root, name, hdr, tr, owner)
	})
}

// eachEntry calls fn for every entry with its validated, cleaned name; an
// unsafe name stops the walk.
func eachEntry(tr *tar.Reader, fn func(hdr *tar.Header, name string) error) error {
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
