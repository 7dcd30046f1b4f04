package fastpull

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
)

// errDigest is a blob whose bytes are not the digest the manifest or the
// config names: a bad registry (or a bad link), never handed to Docker.
var errDigest = errors.New("digest mismatch")

// errRewrite is a write over bytes already written: a fetcher bug, which
// would change bytes a reader may already have.
var errRewrite = errors.New("blob bytes written twice")

// spool is one blob's temporary file while it arrives. The fetcher writes
// each byte once, its ranges in any order (WriteAt); a hasher (verify)
// reads the contiguous prefix as it grows; readers (the loopback
// registry's handlers) get what is written, all but the last byte until
// the whole blob matched its digest, so Docker never holds a complete
// blob that is not the one named. Since no written byte changes, what the
// hasher read is what every reader got.
type spool struct {
	f      *os.File
	size   int64
	digest string // sha256:<hex>

	mu       sync.Mutex // guards the fields below
	spans    []span     // written, sorted, merged
	verified bool       // every byte written and hashed to digest
	err      error      // the fetch failed or the digest did not match
	changed  chan struct{}
}

// span is the written bytes [from, to).
type span struct{ from, to int64 }

func newSpool(f *os.File, size int64, digest string) *spool {
	return &spool{f: f, size: size, digest: digest, changed: make(chan struct{})}
}

// WriteAt writes p at off; bytes already written are refused.
func (s *spool) WriteAt(p []byte, off int64) (int, error) {
	end := off + int64(len(p))
	if off < 0 || end > s.size {
		return 0, fmt.Errorf("write %d bytes at %d of a %d-byte blob", len(p), off, s.size)
	}
	if len(p) == 0 {
		return 0, nil
	}
	s.mu.Lock()
	overlap := s.overlapsLocked(off, end)
	s.mu.Unlock()
	if overlap {
		return 0, fmt.Errorf("bytes %d-%d: %w", off, end-1, errRewrite)
	}
	n, err := s.f.WriteAt(p, off)
	if n > 0 {
		s.mu.Lock()
		s.spans = addSpan(s.spans, span{off, off + int64(n)})
		s.wakeLocked()
		s.mu.Unlock()
	}
	return n, err
}

func (s *spool) overlapsLocked(from, to int64) bool {
	for _, sp := range s.spans {
		if sp.from < to && from < sp.to {
			return true
		}
	}
	return false
}

// addSpan inserts sp into spans (sorted, disjoint, none adjacent) and
// merges what touches it.
func addSpan(spans []span, sp span) []span {
	out := make([]span, 0, len(spans)+1)
	i := 0
	for ; i < len(spans) && spans[i].to < sp.from; i++ {
		out = append(out, spans[i])
	}
	for ; i < len(spans) && spans[i].from <= sp.to; i++ {
		sp.from, sp.to = min(sp.from, spans[i].from), max(sp.to, spans[i].to)
	}
	out = append(out, sp)
	return append(out, spans[i:]...)
}

func (s *spool) prefixLocked() int64 {
	if len(s.spans) > 0 && s.spans[0].from == 0 {
		return s.spans[0].to
	}
	return 0
}

func (s *spool) wakeLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

// fail ends the spool: every reader and the hasher get err.
func (s *spool) fail(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err == nil && !s.verified {
		s.err = err
		s.wakeLocked()
	}
}

// verify hashes the blob as its prefix grows and marks it verified, or
// failed with errDigest; it returns when the blob is one or the other, or
// the fetch failed (fail) or ctx ended.
func (s *spool) verify(ctx context.Context) error {
	h := sha256.New()
	// Every layer of a pull hashes at once (256 at most): 128 KiB each.
	buf := make([]byte, 128<<10)
	var hashed int64
	for hashed < s.size {
		s.mu.Lock()
		avail, err, wait := s.prefixLocked(), s.err, s.changed
		s.mu.Unlock()
		if err != nil {
			return err
		}
		if avail == hashed {
			select {
			case <-wait:
			case <-ctx.Done():
				return context.Cause(ctx)
			}
			continue
		}
		for hashed < avail {
			n, err := s.f.ReadAt(buf[:min(int64(len(buf)), avail-hashed)], hashed)
			h.Write(buf[:n])
			hashed += int64(n)
			if err != nil && !(errors.Is(err, io.EOF) && hashed == avail) {
				err = fmt.Errorf("read temporary blob: %w", err)
				s.fail(err)
				return err
			}
		}
	}
	if got := "sha256:" + hex.EncodeToString(h.Sum(nil)); got != s.digest {
		err := fmt.Errorf("blob %s: %w: got %s", s.digest, errDigest, got)
		s.fail(err)
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return s.err
	}
	s.verified = true
	s.wakeLocked()
	return nil
}

// readAt reads into p what is servable at off, waiting for at least one
// byte: the written prefix, less the last byte until the blob is
// verified. At the blob's end it returns io.EOF.
func (s *spool) readAt(ctx context.Context, p []byte, off int64) (int, error) {
	if off >= s.size {
		return 0, io.EOF
	}
	for {
		s.mu.Lock()
		avail, err, wait := s.prefixLocked(), s.err, s.changed
		if !s.verified {
			avail = min(avail, s.size-1)
		}
		s.mu.Unlock()
		if err != nil {
			return 0, err
		}
		if avail > off {
			n, err := s.f.ReadAt(p[:min(int64(len(p)), avail-off)], off)
			if n > 0 {
				return n, nil
			}
			if err == nil {
				err = io.ErrUnexpectedEOF
			}
			return 0, fmt.Errorf("read temporary blob: %w", err)
		}
		select {
		case <-wait:
		case <-ctx.Done():
			return 0, context.Cause(ctx)
		}
	}
}
