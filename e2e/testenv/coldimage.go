package testenv

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// Cold images: realistic test images for the cold-start bench and the
// fast-pull tests, built from this machine's own binaries, libraries and
// data (/usr/lib, /usr/share, /usr/local/go, ...: 2-3x compressible, as
// CUDA and PyTorch images are; not random bytes, not zeros), FROM scratch
// so that no other image shares a layer, runnable (/bin/sh, sleep). Built
// once per machine into a cache directory (TANDEM_COLD_IMAGE_CACHE,
// default /var/tmp), each layer kept both as the gzip blob a registry
// serves and as its plain tar (for Docker's own unpack floor).

// ColdImageKind names a cold image.
type ColdImageKind string

const (
	// ColdFull: about 1.5 GB compressed (4 GB plain) on a Debian 12 build
	// machine, 6 layers, one of them half the image.
	ColdFull ColdImageKind = "full"
	// ColdSmall: tens of MB, 3 layers, for fast e2e tests.
	ColdSmall ColdImageKind = "small"
	// ColdOneLayer: one layer of about 500 MB compressed.
	ColdOneLayer ColdImageKind = "onelayer"
)

// coldImageVersion names the cache: bump it when a spec below changes.
const coldImageVersion = "v1"

// ColdLayer is one layer of a cold image.
type ColdLayer struct {
	Digest  string // of the gzip blob
	DiffID  string // of the plain tar
	Size    int64  // gzip bytes
	RawSize int64  // tar bytes
	Gz, Tar string // paths in the cache
}

// ColdImage is a built cold image.
type ColdImage struct {
	Kind           ColdImageKind
	Layers         []ColdLayer
	Config         []byte
	ConfigDigest   string // the image ID Docker gives it
	Manifest       []byte // Docker's schema 2 manifest
	ManifestDigest string
}

// Size is the image's compressed size (its layers' blobs).
func (i *ColdImage) Size() int64 {
	var n int64
	for _, l := range i.Layers {
		n += l.Size
	}
	return n
}

// RawSize is what its layers hold unpacked (their tars).
func (i *ColdImage) RawSize() int64 {
	var n int64
	for _, l := range i.Layers {
		n += l.RawSize
	}
	return n
}

// ChainIDs are the layers' chain IDs, the names of their directories in
// Docker's layer database (image/<driver>/layerdb/sha256/<hex>).
func (i *ColdImage) ChainIDs() []string {
	var ids []string
	chain := ""
	for _, l := range i.Layers {
		if chain == "" {
			chain = l.DiffID
		} else {
			sum := sha256.Sum256([]byte(chain + " " + l.DiffID))
			chain = "sha256:" + hex.EncodeToString(sum[:])
		}
		ids = append(ids, chain)
	}
	return ids
}

// layerSpec is what one layer holds: the essentials first (always), then
// files under roots in lexical order until budget bytes of content.
type layerSpec struct {
	essentials []string
	roots      []string
	budget     int64
}

// runnable is what a task's container needs of the image: a shell, sleep,
// their libraries, the top-level links of a merged /usr.
var runnable = []string{"/bin", "/lib", "/lib64", "/sbin", "/usr/bin/sh", "/usr/bin/dash", "/usr/bin/sleep", "/usr/bin/cat",
	"/usr/bin/env", "/usr/bin/true", "/usr/bin/ls", "/usr/lib64/ld-linux-x86-64.so.2", "/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
	"/usr/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libselinux.so.1", "/usr/lib/x86_64-linux-gnu/libpcre2-8.so.0",
	"/usr/lib/aarch64-linux-gnu/ld-linux-aarch64.so.1", "/usr/lib/aarch64-linux-gnu/libc.so.6", "/usr/lib/ld-linux-aarch64.so.1",
	"/etc/passwd", "/etc/group"}

const mb = 1 << 20

func coldSpecs(kind ColdImageKind) []layerSpec {
	switch kind {
	case ColdSmall:
		return []layerSpec{
			{essentials: runnable, roots: []string{"/usr/bin"}, budget: 25 * mb},
			{roots: []string{"/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib"}, budget: 40 * mb},
			{roots: []string{"/usr/share"}, budget: 10 * mb},
		}
	case ColdOneLayer:
		return []layerSpec{
			{essentials: runnable, roots: []string{"/usr/lib", "/usr/share", "/usr/bin"}, budget: 1300 * mb},
		}
	default:
		return []layerSpec{
			{essentials: runnable, roots: []string{"/usr/bin", "/usr/sbin"}, budget: 600 * mb},
			{roots: []string{"/usr/lib"}, budget: 2000 * mb},
			{roots: []string{"/usr/share"}, budget: 450 * mb},
			{roots: []string{"/usr/local/go", "/root/go/pkg/mod", "/usr/local/lib"}, budget: 550 * mb},
			{roots: []string{"/opt", "/usr/include", "/usr/libexec", "/usr/local/bin"}, budget: 450 * mb},
			{roots: []string{"/usr/lib/python3", "/usr/lib/python3.11"}, budget: 30 * mb},
		}
	}
}

// ColdImageCacheDir is where cold images are kept between runs.
func ColdImageCacheDir() string {
	if d := os.Getenv("TANDEM_COLD_IMAGE_CACHE"); d != "" {
		return d
	}
	return "/var/tmp"
}

var coldMu sync.Mutex // one build at a time in this process (the lock file orders processes)

// BuildColdImage returns the cold image of kind, building it on the first
// call on this machine (the full one takes a few minutes of 2 cores).
func BuildColdImage(t testing.TB, kind ColdImageKind) *ColdImage {
	t.Helper()
	coldMu.Lock()
	defer coldMu.Unlock()
	dir := machineCacheIn(t, ColdImageCacheDir(), "tandem-coldimage-"+coldImageVersion+"-"+string(kind), func(dir string) {
		start := time.Now()
		img, err := buildColdImage(dir, kind)
		if err != nil {
			t.Fatalf("build cold image %s: %v", kind, err)
		}
		t.Logf("built cold image %s in %s: %d layers, %.0f MB compressed, %.0f MB plain", kind, time.Since(start).Round(time.Second), len(img.Layers), float64(img.Size())/1e6, float64(img.RawSize())/1e6)
	})
	b, err := os.ReadFile(filepath.Join(dir, "image.json"))
	if err != nil {
		t.Fatal(err)
	}
	var img ColdImage
	if err := json.Unmarshal(b, &img); err != nil {
		t.Fatal(err)
	}
	for i := range img.Layers {
		img.Layers[i].Gz = filepath.Join(dir, img.Layers[i].Gz)
		img.Layers[i].Tar = filepath.Join(dir, img.Layers[i].Tar)
	}
	return &img
}

func buildColdImage(dir string, kind ColdImageKind) (*ColdImage, error) {
	specs := coldSpecs(kind)
	img := &ColdImage{Kind: kind, Layers: make([]ColdLayer, len(specs))}
	errs := make([]error, len(specs))
	// Layers in parallel, as many as there are cores: gzip is the cost.
	sem := make(chan struct{}, runtime.GOMAXPROCS(0))
	var wg sync.WaitGroup
	for i, s := range specs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			img.Layers[i], errs[i] = buildLayer(dir, fmt.Sprintf("layer%d", i), s)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return nil, err
		}
	}
	if err := img.assemble(); err != nil {
		return nil, err
	}
	b, err := json.MarshalIndent(img, "", " ")
	if err != nil {
		return nil, err
	}
	return img, os.WriteFile(filepath.Join(dir, "image.json"), b, 0o644)
}

// assemble makes the config and manifest of i's layers.
func (i *ColdImage) assemble() error {
	var diffIDs []string
	for _, l := range i.Layers {
		diffIDs = append(diffIDs, l.DiffID)
	}
	arch := runtime.GOARCH
	cfg, err := json.Marshal(map[string]any{
		"architecture": arch, "os": "linux", "created": "2026-01-01T00:00:00Z",
		"config":  map[string]any{"Env": []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}, "Cmd": []string{"/bin/sh"}},
		"rootfs":  map[string]any{"type": "layers", "diff_ids": diffIDs},
		"history": []map[string]any{{"created": "2026-01-01T00:00:00Z", "created_by": "tandem cold image " + string(i.Kind)}},
	})
	if err != nil {
		return err
	}
	i.Config = cfg
	i.ConfigDigest = digestOf(cfg)
	type desc struct {
		MediaType string `json:"mediaType"`
		Size      int64  `json:"size"`
		Digest    string `json:"digest"`
	}
	m := struct {
		SchemaVersion int    `json:"schemaVersion"`
		MediaType     string `json:"mediaType"`
		Config        desc   `json:"config"`
		Layers        []desc `json:"layers"`
	}{2, "application/vnd.docker.distribution.manifest.v2+json",
		desc{"application/vnd.docker.container.image.v1+json", int64(len(cfg)), i.ConfigDigest}, nil}
	for _, l := range i.Layers {
		m.Layers = append(m.Layers, desc{"application/vnd.docker.image.rootfs.diff.tar.gzip", l.Size, l.Digest})
	}
	i.Manifest, err = json.MarshalIndent(m, "", "   ")
	if err != nil {
		return err
	}
	i.ManifestDigest = digestOf(i.Manifest)
	return nil
}

// Salted is i with one more layer at the bottom: one small file holding
// salt. Every layer's chain ID (what Docker's layer store keys them by)
// is then this image's own, so no other image in Docker's store (another
// run's, another test's pull of the same cold image) holds any of them
// and a pull must fetch and unpack every one; the config, its digest (the
// image ID) and the manifest are the salted image's. Its layer's files go
// under a temp dir of t.
func (i *ColdImage) Salted(t testing.TB, salt string) *ColdImage {
	t.Helper()
	dir := t.TempDir()
	l, err := buildSaltLayer(dir, salt)
	if err != nil {
		t.Fatalf("salt layer: %v", err)
	}
	s := &ColdImage{Kind: i.Kind, Layers: append([]ColdLayer{l}, i.Layers...)}
	if err := s.assemble(); err != nil {
		t.Fatal(err)
	}
	return s
}

func buildSaltLayer(dir, salt string) (ColdLayer, error) {
	l := ColdLayer{Tar: filepath.Join(dir, "salt.tar"), Gz: filepath.Join(dir, "salt.tar.gz")}
	var tb bytes.Buffer
	tw := tar.NewWriter(&tb)
	hdrs := []*tar.Header{
		{Name: "etc/", Typeflag: tar.TypeDir, Mode: 0o755, ModTime: time.Unix(0, 0)},
		{Name: "etc/tandem-cold-salt", Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(salt)), ModTime: time.Unix(0, 0)},
	}
	for _, h := range hdrs {
		if err := tw.WriteHeader(h); err != nil {
			return l, err
		}
	}
	if _, err := tw.Write([]byte(salt)); err != nil {
		return l, err
	}
	if err := tw.Close(); err != nil {
		return l, err
	}
	var gb bytes.Buffer
	zw := gzip.NewWriter(&gb)
	if _, err := zw.Write(tb.Bytes()); err != nil {
		return l, err
	}
	if err := zw.Close(); err != nil {
		return l, err
	}
	if err := os.WriteFile(l.Tar, tb.Bytes(), 0o644); err != nil {
		return l, err
	}
	if err := os.WriteFile(l.Gz, gb.Bytes(), 0o644); err != nil {
		return l, err
	}
	l.DiffID, l.Digest = digestOf(tb.Bytes()), digestOf(gb.Bytes())
	l.RawSize, l.Size = int64(tb.Len()), int64(gb.Len())
	return l, nil
}

func digestOf(b []byte) string {
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// buildLayer writes name.tar and name.tar.gz in one pass.
func buildLayer(dir, name string, s layerSpec) (ColdLayer, error) {
	l := ColdLayer{Tar: name + ".tar", Gz: name + ".tar.gz"}
	tf, err := os.Create(filepath.Join(dir, l.Tar))
	if err != nil {
		return l, err
	}
	defer tf.Close()
	gf, err := os.Create(filepath.Join(dir, l.Gz))
	if err != nil {
		return l, err
	}
	defer gf.Close()
	gzSum, tarSum := sha256.New(), sha256.New()
	gbw := bufio.NewWriterSize(gf, 1<<20)
	gzOut := &countingWriter{w: io.MultiWriter(gbw, gzSum)}
	zw := gzip.NewWriter(gzOut)
	tbw := bufio.NewWriterSize(tf, 1<<20)
	tarOut := &countingWriter{w: io.MultiWriter(tbw, tarSum, zw)}
	tw := tar.NewWriter(tarOut)
	if err := writeLayerTar(tw, s); err != nil {
		return l, err
	}
	if err := tw.Close(); err != nil {
		return l, err
	}
	if err := zw.Close(); err != nil {
		return l, err
	}
	for _, f := range []interface{ Flush() error }{gbw, tbw} {
		if err := f.Flush(); err != nil {
			return l, err
		}
	}
	l.Size, l.RawSize = gzOut.n, tarOut.n
	l.Digest, l.DiffID = sumOf(gzSum), sumOf(tarSum)
	return l, nil
}

func sumOf(h hash.Hash) string { return "sha256:" + hex.EncodeToString(h.Sum(nil)) }

// writeLayerTar writes the essentials (with their parent directories),
// then what the roots hold up to the budget. Only directories, regular
// files and symlinks; what cannot be read is left out.
func writeLayerTar(tw *tar.Writer, s layerSpec) error {
	seen := map[string]bool{}
	var content int64
	add := func(path string, fi fs.FileInfo) error {
		if seen[path] || path == "/" {
			return nil
		}
		mode := fi.Mode()
		if !mode.IsRegular() && !mode.IsDir() && mode&fs.ModeSymlink == 0 {
			return nil
		}
		link := ""
		if mode&fs.ModeSymlink != 0 {
			var err error
			if link, err = os.Readlink(path); err != nil {
				return nil
			}
		}
		hdr, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return nil
		}
		hdr.Name = strings.TrimPrefix(path, "/")
		if mode.IsDir() {
			hdr.Name += "/"
		}
		hdr.Uname, hdr.Gname = "", ""
		hdr.Format = tar.FormatPAX
		var f *os.File
		if mode.IsRegular() {
			if f, err = os.Open(path); err != nil {
				return nil // unreadable: left out
			}
			defer f.Close()
		}
		seen[path] = true
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if f != nil {
			if _, err := io.CopyN(tw, f, hdr.Size); err != nil {
				return fmt.Errorf("%s: %w", path, err)
			}
			content += hdr.Size
		}
		return nil
	}
	addWithParents := func(path string) error {
		var chain []string
		for p := filepath.Dir(path); p != "/" && p != "."; p = filepath.Dir(p) {
			chain = append([]string{p}, chain...)
		}
		for _, p := range append(chain, path) {
			fi, err := os.Lstat(p)
			if err != nil {
				return nil
			}
			if err := add(p, fi); err != nil {
				return err
			}
		}
		return nil
	}
	for _, e := range s.essentials {
		if err := addWithParents(e); err != nil {
			return err
		}
	}
	for _, root := range s.roots {
		if content >= s.budget {
			break
		}
		if _, err := os.Lstat(root); err != nil {
			continue
		}
		if err := addWithParents(root); err != nil {
			return err
		}
		err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
			if err != nil {
				return nil
			}
			if content >= s.budget {
				return filepath.SkipAll
			}
			fi, err := d.Info()
			if err != nil {
				return nil
			}
			if fi.Mode().IsRegular() && content+fi.Size() > s.budget+64*mb {
				return nil // one file would overshoot: leave it
			}
			return add(path, fi)
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// WriteSave writes the image as `docker save` lays it out, its layers
// plain (uncompressed), tagged tag: what `docker load` of it takes is
// Docker's own unpack, with no download and no gunzip.
func (i *ColdImage) WriteSave(w io.Writer, tag string) error {
	tw := tar.NewWriter(w)
	file := func(name string, size int64, body io.Reader) error {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: size, Typeflag: tar.TypeReg, ModTime: time.Unix(0, 0)}); err != nil {
			return err
		}
		_, err := io.CopyN(tw, body, size)
		return err
	}
	cfgName := strings.TrimPrefix(i.ConfigDigest, "sha256:") + ".json"
	if err := file(cfgName, int64(len(i.Config)), strings.NewReader(string(i.Config))); err != nil {
		return err
	}
	var layers []string
	for n, l := range i.Layers {
		name := fmt.Sprintf("l%d/layer.tar", n)
		layers = append(layers, name)
		f, err := os.Open(l.Tar)
		if err != nil {
			return err
		}
		err = file(name, l.RawSize, f)
		f.Close()
		if err != nil {
			return err
		}
	}
	m, err := json.Marshal([]map[string]any{{"Config": cfgName, "RepoTags": []string{tag}, "Layers": layers}})
	if err != nil {
		return err
	}
	if err := file("manifest.json", int64(len(m)), strings.NewReader(string(m))); err != nil {
		return err
	}
	return tw.Close()
}
