package fastpull

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// fetcher downloads blobs over ranged requests. conns bounds the requests
// one pull has open (all its blobs together), so two pulls share a link
// instead of one starving the other.
type fetcher struct {
	client *http.Client
	conns  *gate
	chunk  int64
	idle   time.Duration // a request that moves no byte this long is retried
	// budget is the temporary disk this pull may still write.
	budget *atomic.Int64
}

// errBudget is a pull that would write more temporary data than allowed.
var errBudget = errors.New("temporary disk budget exhausted")

func (f *fetcher) take(n int64) error {
	if f.budget.Add(-n) < 0 {
		return errBudget
	}
	return nil
}

// fetch writes blob url (size bytes) into dst, each byte once, reporting
// each written byte count to moved. The first request asks for the first
// chunk: a 206 with a Content-Range that matches means the rest goes in
// parallel, over further ranges against the URL it ended at (a redirect is
// followed once, by the first request); a 200 is a registry that does not
// range, read on that one connection. A request tried again asks only for
// what its range still lacks (a registry that answers that with the whole
// blob has the bytes already written skipped), so no byte a reader of dst
// may have read is written again.
//
// layer is the blob's place in the image: its requests wait for a
// connection behind those of earlier layers.
func (f *fetcher) fetch(ctx context.Context, url string, layer int, size int64, dst io.WriterAt, moved func(int64)) error {
	if size <= 0 || size > maxBlob {
		return fmt.Errorf("blob size %d out of range", size)
	}
	if err := f.take(size); err != nil {
		return err
	}
	first := min(f.chunk, size)
	var final string
	var ranged, whole bool
	var done int64
	if err := f.conns.acquire(ctx, rank(layer, 0)); err != nil {
		return err
	}
	err := f.attempt(ctx, func(ctx context.Context) error {
		want := first
		if whole {
			want = size
		}
		resp, err := f.get(ctx, url, done, want-done, size)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		final = resp.Request.URL.String()
		if resp.StatusCode == http.StatusOK {
			// No range support: the whole blob on this connection.
			if resp.ContentLength >= 0 && resp.ContentLength != size {
				return permanent(fmt.Errorf("blob is %d bytes, the manifest says %d", resp.ContentLength, size))
			}
			whole, ranged = true, false
			k, err := f.copyAt(ctx, dst, resp.Body, done, size-done, done, moved)
			done += k
			return err
		}
		ranged = !whole
		k, err := f.copyAt(ctx, dst, resp.Body, done, want-done, 0, moved)
		done += k
		return err
	})
	f.conns.release()
	if err != nil || !ranged || first == size {
		return err
	}
	var wg sync.WaitGroup
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	for off := first; off < size; off += f.chunk {
		n := min(f.chunk, size-off)
		wg.Add(1)
		go func() {
			defer wg.Done()
			if f.conns.acquire(ctx, rank(layer, off)) != nil {
				return
			}
			defer f.conns.release()
			var done int64
			err := f.attempt(ctx, func(ctx context.Context) error {
				resp, err := f.get(ctx, final, off+done, n-done, size)
				if err != nil {
					return err
				}
				defer resp.Body.Close()
				if resp.StatusCode != http.StatusPartialContent {
					return permanent(fmt.Errorf("range %d-%d: the final URL answered %s", off+done, off+n-1, resp.Status))
				}
				k, err := f.copyAt(ctx, dst, resp.Body, off+done, n-done, 0, moved)
				done += k
				return err
			})
			if err != nil {
				cancel(err)
			}
		}()
	}
	wg.Wait()
	return context.Cause(ctx)
}

// attempt runs one request up to three times: a connection that breaks
// or goes idle is tried again, a wrong answer is not.
func (f *fetcher) attempt(ctx context.Context, do func(context.Context) error) error {
	var err error
	for range 3 {
		if err = do(ctx); err == nil {
			return nil
		}
		var p permanentError
		if errors.As(err, &p) || ctx.Err() != nil {
			return err
		}
	}
	return err
}

type permanentError struct{ error }

func (p permanentError) Unwrap() error { return p.error }

func permanent(err error) error { return permanentError{err} }

// get asks for n bytes at off of a blob of size bytes. A 206 must say
// exactly that range; anything but 200 or 206 is an error.
func (f *fetcher) get(ctx context.Context, url string, off, n, size int64) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, permanent(fmt.Errorf("blob request: %w", err))
	}
	if n < size {
		req.Header.Set("Range", "bytes="+strconv.FormatInt(off, 10)+"-"+strconv.FormatInt(off+n-1, 10))
	}
	resp, err := f.client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("blob request: %w", err)
	}
	switch resp.StatusCode {
	case http.StatusOK:
		return resp, nil
	case http.StatusPartialContent:
		cr, err := parseContentRange(resp.Header.Get("Content-Range"))
		if err == nil && (cr.First != off || cr.Last != off+n-1 || cr.Size != size) {
			err = fmt.Errorf("content-range %q for bytes %d-%d of %d", resp.Header.Get("Content-Range"), off, off+n-1, size)
		}
		if err != nil {
			resp.Body.Close()
			return nil, permanent(err)
		}
		return resp, nil
	}
	resp.Body.Close()
	return nil, permanent(fmt.Errorf("blob request: %s", resp.Status))
}

// copyAt skips skip bytes of r (bytes of a whole-blob answer written
// already), then writes exactly n bytes of it at off in dst, and returns
// how many it wrote; a read that brings no byte for f.idle ends the
// request (the caller may try it again for the rest).
func (f *fetcher) copyAt(ctx context.Context, dst io.WriterAt, r io.Reader, off, n, skip int64, moved func(int64)) (int64, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	idle := time.AfterFunc(f.idle, cancel)
	defer idle.Stop()
	go func() {
		<-ctx.Done()
		if c, ok := r.(io.Closer); ok {
			c.Close() // unblocks a read that waits on a silent connection
		}
	}()
	buf := make([]byte, 256<<10)
	var done int64
	for skip > 0 || done < n {
		want := min(int64(len(buf)), n-done)
		if skip > 0 {
			want = min(int64(len(buf)), skip)
		}
		k, err := r.Read(buf[:want])
		if k > 0 {
			idle.Reset(f.idle)
			if skip > 0 {
				skip -= int64(k)
			} else {
				if _, werr := dst.WriteAt(buf[:k], off+done); werr != nil {
					return done, permanent(fmt.Errorf("write blob: %w", werr))
				}
				done += int64(k)
				moved(int64(k))
			}
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			if ctx.Err() != nil {
				return done, fmt.Errorf("blob read idle for %s: %w", f.idle, err)
			}
			return done, fmt.Errorf("blob read: %w", err)
		}
	}
	if done != n {
		return done, fmt.Errorf("blob range at %d: %d bytes of %d", off, done, n)
	}
	// A 200 that sends more than the manifest says is a wrong blob.
	var one [1]byte
	if k, _ := r.Read(one[:]); k > 0 {
		return done, permanent(fmt.Errorf("blob longer than the %d bytes asked", n))
	}
	return done, nil
}
