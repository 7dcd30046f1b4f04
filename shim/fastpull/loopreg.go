package fastpull

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// loopRepoPrefix names every loopback registry's one repository; a random
// 128-bit hex name follows it.
const loopRepoPrefix = "tandem-fastpull/"

// maxLoopConns bounds the connections a loopback registry holds at once
// (Docker opens one per blob it downloads, three at a time by default).
const maxLoopConns = 64

// blobSource is one layer blob a loopback registry serves: its spool, and
// start, which begins its fetch if nothing has yet (a layer Docker asks
// for that the shim took for one it already holds).
type blobSource struct {
	sp    *spool
	start func()
}

// loopImage is what one loopback registry serves: one image's manifest
// (by its tag and its digest), its config and its layer blobs. Anything
// else is a 404.
type loopImage struct {
	repo           string // loopRepoPrefix + 32 hex
	tag            string
	manifest       []byte
	mediaType      string
	manifestDigest string
	config         []byte
	configDigest   string
	blobs          map[string]blobSource // by digest
}

// loopRegistry is the read-only OCI distribution registry one fast pull
// serves Docker on 127.0.0.1 (which Docker takes as an insecure, plain
// HTTP registry by default), so Docker's own pull reads each blob as its
// bytes come from upstream and unpacks layers while later ones still
// arrive. It lives for that one pull. Each connection passes admit (the
// shim's rule for who is root-equivalent on the host: Docker's daemon
// is; another local account, which could otherwise read a task's image
// here, is not) and holds one of maxLoopConns slots.
type loopRegistry struct {
	img loopImage
	log *slog.Logger
	srv *http.Server
	ln  net.Listener
	// ctx ends every wait of a handler once the pull is over.
	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}
}

// newRepoName is a repository name no other local account can guess.
func newRepoName() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("random repository name: %w", err)
	}
	return loopRepoPrefix + hex.EncodeToString(b[:]), nil
}

// startLoopRegistry serves img on 127.0.0.1 on an ephemeral port until
// close. admit, when set, decides each accepted connection.
func startLoopRegistry(ctx context.Context, img loopImage, admit func(net.Conn) (bool, string), log *slog.Logger) (*loopRegistry, error) {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp4", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("loopback registry: listen: %w", err)
	}
	r := &loopRegistry{img: img, log: log, ln: ln, done: make(chan struct{})}
	r.ctx, r.cancel = context.WithCancel(context.WithoutCancel(ctx))
	r.srv = &http.Server{
		Handler:           r,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       30 * time.Second,
		MaxHeaderBytes:    16 << 10,
		ErrorLog:          logger(log),
		BaseContext:       func(net.Listener) context.Context { return r.ctx },
	}
	al := &admitListener{Listener: ln, admit: admit, slots: make(chan struct{}, maxLoopConns), log: log}
	go func() {
		defer close(r.done)
		if err := r.srv.Serve(al); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Warn("loopback registry stopped", "err", err)
		}
	}()
	return r, nil
}

// logger puts the HTTP server's own complaints (a TLS hello on this plain
// port: Docker tries https first) in the debug log.
func logger(l *slog.Logger) *log.Logger {
	return slog.NewLogLogger(l.Handler(), slog.LevelDebug)
}

// Host is the registry's host:port.
func (r *loopRegistry) Host() string { return r.ln.Addr().String() }

// Ref is the reference Docker pulls: host:port/repo:tag.
func (r *loopRegistry) Ref() string { return r.Host() + "/" + r.img.repo + ":" + r.img.tag }

// close stops serving: open streams are broken off, waits end.
func (r *loopRegistry) close() {
	r.cancel()
	_ = r.srv.Close()
	<-r.done
}

func (r *loopRegistry) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	if req.Method != http.MethodGet && req.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		http.Error(w, "read-only registry", http.StatusMethodNotAllowed)
		return
	}
	w.Header().Set("Docker-Distribution-API-Version", "registry/2.0")
	kind, ref := parseV2Path(req.URL.Path, r.img.repo)
	switch kind {
	case pathBase:
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, "{}")
	case pathManifest:
		if ref != r.img.tag && ref != r.img.manifestDigest {
			notFound(w, "MANIFEST_UNKNOWN")
			return
		}
		r.serveBytes(w, req, r.img.manifest, r.img.mediaType, r.img.manifestDigest)
	case pathBlob:
		if ref == r.img.configDigest {
			r.serveBytes(w, req, r.img.config, "application/octet-stream", r.img.configDigest)
			return
		}
		src, ok := r.img.blobs[ref]
		if !ok {
			notFound(w, "BLOB_UNKNOWN")
			return
		}
		r.serveBlob(w, req, ref, src)
	default:
		notFound(w, "NAME_UNKNOWN")
	}
}

func notFound(w http.ResponseWriter, code string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusNotFound)
	_, _ = io.WriteString(w, `{"errors":[{"code":"`+code+`","message":"not here"}]}`)
}

func (r *loopRegistry) serveBytes(w http.ResponseWriter, req *http.Request, b []byte, ctype, digest string) {
	w.Header().Set("Content-Type", ctype)
	w.Header().Set("Docker-Content-Digest", digest)
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	if req.Method == http.MethodHead {
		return
	}
	_, _ = w.Write(b)
}

// serveBlob streams a layer blob (or the range asked of it) as its bytes
// arrive. A blob that fails (its fetch, its digest) breaks the connection
// off mid-body: Docker never holds a complete wrong blob.
func (r *loopRegistry) serveBlob(w http.ResponseWriter, req *http.Request, digest string, src blobSource) {
	size := src.sp.size
	from, to, partial, ok := parseRange(req.Header.Get("Range"), size)
	if !ok {
		w.Header().Set("Content-Range", "bytes */"+strconv.FormatInt(size, 10))
		http.Error(w, "range not satisfiable", http.StatusRequestedRangeNotSatisfiable)
		return
	}
	h := w.Header()
	h.Set("Content-Type", "application/octet-stream")
	h.Set("Docker-Content-Digest", digest)
	h.Set("Accept-Ranges", "bytes")
	h.Set("Content-Length", strconv.FormatInt(to-from, 10))
	status := http.StatusOK
	if partial {
		h.Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", from, to-1, size))
		status = http.StatusPartialContent
	}
	if req.Method == http.MethodHead {
		w.WriteHeader(status)
		return
	}
	src.start()
	w.WriteHeader(status)
	flusher, _ := w.(http.Flusher)
	if flusher != nil {
		flusher.Flush() // Docker sees the answer before the first byte is here
	}
	ctx := req.Context()
	buf := make([]byte, 256<<10)
	for off := from; off < to; {
		n, err := src.sp.readAt(ctx, buf[:min(int64(len(buf)), to-off)], off)
		if err != nil {
			if ctx.Err() == nil {
				r.log.Warn("loopback registry broke a blob off", "digest", digest, "at", off, "err", err)
			}
			panic(http.ErrAbortHandler) // the connection is cut, not ended
		}
		if _, err := w.Write(buf[:n]); err != nil {
			return // Docker went away
		}
		if flusher != nil {
			flusher.Flush()
		}
		off += int64(n)
	}
}

// Kinds of request path parseV2Path knows.
const (
	pathOther = iota
	pathBase
	pathManifest
	pathBlob
)

// maxRefLen bounds a manifest reference or blob digest in a path (a tag
// is at most 128 characters, a sha512 digest 135).
const maxRefLen = 160

// parseV2Path reads a distribution API path of repository repo: /v2/ (the
// base, which says the API is spoken), /v2/<repo>/manifests/<ref> or
// /v2/<repo>/blobs/<digest>, ref one path element of at most maxRefLen
// bytes. Any other path, another repository's included, is pathOther.
func parseV2Path(path, repo string) (kind int, ref string) {
	if path == "/v2/" || path == "/v2" {
		return pathBase, ""
	}
	rest, ok := strings.CutPrefix(path, "/v2/"+repo+"/")
	if !ok || repo == "" {
		return pathOther, ""
	}
	for _, k := range []struct {
		prefix string
		kind   int
	}{{"manifests/", pathManifest}, {"blobs/", pathBlob}} {
		ref, ok := strings.CutPrefix(rest, k.prefix)
		if !ok {
			continue
		}
		if ref == "" || len(ref) > maxRefLen || strings.Contains(ref, "/") {
			return pathOther, ""
		}
		return k.kind, ref
	}
	return pathOther, ""
}

// parseRange reads a request's Range header for a blob of size bytes as
// one span [from, to): "" or a header this server does not range on (a
// multi-range, another unit, a malformed one: RFC 9110 lets a server
// ignore those) is the whole blob, not partial; "bytes=a-", "bytes=a-b"
// (b past the end is the end) and "bytes=-n" (the last n) are one
// range. ok is false for a range that starts at or past the end.
func parseRange(h string, size int64) (from, to int64, partial, ok bool) {
	spec, found := strings.CutPrefix(h, "bytes=")
	if h == "" || !found || strings.Contains(spec, ",") {
		return 0, size, false, true
	}
	first, last, found := strings.Cut(strings.TrimSpace(spec), "-")
	if !found {
		return 0, size, false, true
	}
	if first == "" {
		n, err := decimal(last)
		if err != nil {
			return 0, size, false, true
		}
		if n == 0 {
			return 0, 0, false, false
		}
		return max(0, size-n), size, true, true
	}
	a, err := decimal(first)
	if err != nil {
		return 0, size, false, true
	}
	b := size - 1
	if last != "" {
		if b, err = decimal(last); err != nil || b < a {
			return 0, size, false, true
		}
		b = min(b, size-1)
	}
	if a >= size {
		return 0, 0, false, false
	}
	return a, b + 1, true, true
}

// admitListener hands the HTTP server only connections that admit lets
// in, and at most cap(slots) at once: one past that is closed at accept.
type admitListener struct {
	net.Listener
	admit func(net.Conn) (bool, string)
	slots chan struct{}
	log   *slog.Logger
}

func (l *admitListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		select {
		case l.slots <- struct{}{}:
		default:
			l.log.Warn("loopback registry refused a connection: every slot is taken", "peer", c.RemoteAddr().String(), "slots", cap(l.slots))
			c.Close()
			continue
		}
		if l.admit != nil {
			if ok, why := l.admit(c); !ok {
				l.log.Warn("loopback registry refused a connection", "peer", c.RemoteAddr().String(), "why", why)
				c.Close()
				<-l.slots
				continue
			}
		}
		return &slotConn{Conn: c, release: func() { <-l.slots }}, nil
	}
}

// slotConn gives its slot back when closed (once).
type slotConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (c *slotConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}
