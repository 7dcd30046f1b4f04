package fastpull

import (
	"bufio"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"os/exec"
)

// errDigest is a blob whose bytes are not the digest the manifest or the
// config names: a bad registry (or a bad link), never handed to Docker.
var errDigest = errors.New("digest mismatch")

// countingReader reports what it reads to moved and hashes it.
type countingReader struct {
	r     io.Reader
	h     hash.Hash
	moved func(int64)
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	if n > 0 {
		c.h.Write(p[:n])
		c.moved(int64(n))
	}
	return n, err
}

// budgetWriter fails once the pull's temporary disk budget is spent.
type budgetWriter struct {
	w    io.Writer
	take func(int64) error
}

func (b budgetWriter) Write(p []byte) (int, error) {
	if err := b.take(int64(len(p))); err != nil {
		return 0, err
	}
	return b.w.Write(p)
}

// inflate reads the compressed blob src (digest want, gzip when gzipped,
// a plain tar otherwise) into dst, the layer's tar, which must hash to
// diffID. pigz, when set, is the path of a pigz binary to inflate with
// (faster than compress/gzip); moved counts compressed bytes read.
func inflate(ctx context.Context, src, dst *os.File, want, diffID string, gzipped bool, pigz string, take func(int64) error, moved func(int64)) error {
	in := &countingReader{r: bufio.NewReaderSize(src, 1<<20), h: sha256.New(), moved: moved}
	outHash := sha256.New()
	bw := bufio.NewWriterSize(budgetWriter{w: dst, take: take}, 1<<20)
	out := io.MultiWriter(bw, outHash)
	var err error
	switch {
	case !gzipped:
		_, err = io.Copy(out, in)
	case pigz != "":
		cmd := exec.CommandContext(ctx, pigz, "-d", "-c")
		cmd.Stdin, cmd.Stdout = in, out
		if err = cmd.Run(); err != nil {
			err = fmt.Errorf("pigz -d: %w", err)
		}
	default:
		var zr *gzip.Reader
		if zr, err = gzip.NewReader(in); err == nil {
			_, err = io.Copy(out, zr)
			// Read to the end so the compressed digest covers every byte.
			if err == nil {
				_, err = io.Copy(io.Discard, in)
			}
		}
		if err != nil {
			err = fmt.Errorf("gunzip: %w", err)
		}
	}
	if err == nil {
		err = bw.Flush()
	}
	if err != nil {
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
		// A blob that does not inflate is most likely a wrong blob.
		if got := "sha256:" + hex.EncodeToString(in.h.Sum(nil)); got != want {
			return fmt.Errorf("layer %s: %w (got %s after a failed inflate: %v)", want, errDigest, got, err)
		}
		return fmt.Errorf("layer %s: %w", want, err)
	}
	if got := "sha256:" + hex.EncodeToString(in.h.Sum(nil)); got != want {
		return fmt.Errorf("layer %s: %w: got %s", want, errDigest, got)
	}
	if got := "sha256:" + hex.EncodeToString(outHash.Sum(nil)); got != diffID {
		return fmt.Errorf("layer %s: %w: uncompressed %s, the config says %s", want, errDigest, got, diffID)
	}
	return nil
}
