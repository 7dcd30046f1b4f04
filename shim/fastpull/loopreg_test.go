package fastpull

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// testSpool is a spool of a blob of size random bytes (its digest the
// right one unless digest is given).
func testSpool(t *testing.T, blob []byte, digest string) *spool {
	t.Helper()
	f, err := os.Create(filepath.Join(t.TempDir(), "blob"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	if digest == "" {
		digest = digestOf(blob)
	}
	return newSpool(f, int64(len(blob)), digest)
}

func randomBytes(n int) []byte {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return b
}

// testRegistry serves one image of one layer (sp) and a config; started
// counts the layer's start calls.
func testRegistry(t *testing.T, sp *spool, admit func(net.Conn) (bool, string)) (*loopRegistry, loopImage, *atomic.Int32) {
	t.Helper()
	cfg := []byte(`{"rootfs":{"type":"layers","diff_ids":[]}}`)
	manifest := []byte(`{"schemaVersion":2}`)
	repo, err := newRepoName()
	if err != nil {
		t.Fatal(err)
	}
	var started atomic.Int32
	img := loopImage{
		repo: repo, tag: "v1", manifest: manifest, mediaType: "application/vnd.docker.distribution.manifest.v2+json",
		manifestDigest: digestOf(manifest), config: cfg, configDigest: digestOf(cfg),
		blobs: map[string]blobSource{sp.digest: {sp: sp, start: func() { started.Add(1) }}},
	}
	r, err := startLoopRegistry(context.Background(), img, admit, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.close)
	return r, img, &started
}

func httpGet(t *testing.T, url string, hdr ...string) (int, http.Header, []byte) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, url, nil)
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, b
}

// The registry serves its one image, by tag and digest, and nothing else.
func TestLoopRegistryServesOnlyItsImage(t *testing.T) {
	blob := randomBytes(1000)
	sp := testSpool(t, blob, "")
	if _, err := sp.WriteAt(blob, 0); err != nil {
		t.Fatal(err)
	}
	if err := sp.verify(context.Background()); err != nil {
		t.Fatal(err)
	}
	r, img, started := testRegistry(t, sp, nil)
	base := "http://" + r.Host() + "/v2/"
	if !strings.HasPrefix(r.Ref(), r.Host()+"/"+loopRepoPrefix) || len(img.repo) != len(loopRepoPrefix)+32 {
		t.Fatalf("ref %s", r.Ref())
	}
	other, err := newRepoName()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		path   string
		status int
		body   []byte
	}{
		{"", http.StatusOK, []byte("{}")},
		{img.repo + "/manifests/v1", http.StatusOK, img.manifest},
		{img.repo + "/manifests/" + img.manifestDigest, http.StatusOK, img.manifest},
		{img.repo + "/blobs/" + img.configDigest, http.StatusOK, img.config},
		{img.repo + "/blobs/" + sp.digest, http.StatusOK, blob},
		{img.repo + "/manifests/v2", http.StatusNotFound, nil},
		{img.repo + "/manifests/latest", http.StatusNotFound, nil},
		{img.repo + "/blobs/" + digestOf([]byte("x")), http.StatusNotFound, nil},
		{other + "/manifests/v1", http.StatusNotFound, nil},
		{other + "/blobs/" + sp.digest, http.StatusNotFound, nil},
		{"library/busybox/manifests/latest", http.StatusNotFound, nil},
		{img.repo + "/blobs/../manifests/v1", http.StatusNotFound, nil},
		{img.repo + "/tags/list", http.StatusNotFound, nil},
		{"_catalog", http.StatusNotFound, nil},
	} {
		status, hdr, body := httpGet(t, base+c.path)
		if status != c.status || (c.body != nil && !bytes.Equal(body, c.body)) {
			t.Errorf("GET /v2/%s: %d %q, want %d", c.path, status, body, c.status)
		}
		if status == http.StatusOK && c.path != "" && hdr.Get("Docker-Content-Digest") != digestOf(c.body) {
			t.Errorf("GET /v2/%s: Docker-Content-Digest %q", c.path, hdr.Get("Docker-Content-Digest"))
		}
	}
	if started.Load() != 1 {
		t.Fatalf("the layer's fetch started %d times by one GET", started.Load())
	}
	// Ranges: Docker resumes a broken download with bytes=N-.
	status, hdr, body := httpGet(t, base+img.repo+"/blobs/"+sp.digest, "Range", "bytes=900-")
	if status != http.StatusPartialContent || !bytes.Equal(body, blob[900:]) || hdr.Get("Content-Range") != "bytes 900-999/1000" {
		t.Fatalf("range: %d %s %d bytes", status, hdr.Get("Content-Range"), len(body))
	}
	if status, _, _ := httpGet(t, base+img.repo+"/blobs/"+sp.digest, "Range", "bytes=1000-"); status != http.StatusRequestedRangeNotSatisfiable {
		t.Fatalf("range past the end: %d", status)
	}
	req, _ := http.NewRequest(http.MethodPut, base+img.repo+"/blobs/uploads/", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed {
		t.Fatalf("PUT: %d", resp.StatusCode)
	}
}

// A blob streams as it is written, its last byte held until its digest
// matched.
func TestLoopRegistryHoldsLastByteUntilDigest(t *testing.T) {
	blob := randomBytes(3000)
	sp := testSpool(t, blob, "")
	r, img, _ := testRegistry(t, sp, nil)
	resp, err := http.Get("http://" + r.Host() + "/v2/" + img.repo + "/blobs/" + sp.digest)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.ContentLength != 3000 {
		t.Fatalf("%s, %d bytes", resp.Status, resp.ContentLength)
	}
	// Written out of order: the first 1000 bytes come when they are there.
	if _, err := sp.WriteAt(blob[2000:], 2000); err != nil {
		t.Fatal(err)
	}
	if _, err := sp.WriteAt(blob[:1000], 0); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 3000)
	if _, err := io.ReadFull(resp.Body, got[:1000]); err != nil || !bytes.Equal(got[:1000], blob[:1000]) {
		t.Fatalf("first 1000 bytes: %v", err)
	}
	if _, err := sp.WriteAt(blob[1000:2000], 1000); err != nil {
		t.Fatal(err)
	}
	if _, err := sp.WriteAt(blob[1500:1600], 1500); !errors.Is(err, errRewrite) {
		t.Fatalf("a rewrite: %v", err)
	}
	if _, err := io.ReadFull(resp.Body, got[1000:2999]); err != nil {
		t.Fatal(err)
	}
	// Every byte is written, the digest not yet checked: the last waits.
	last := make(chan error, 1)
	go func() {
		_, err := io.ReadFull(resp.Body, got[2999:])
		last <- err
	}()
	select {
	case err := <-last:
		t.Fatalf("the last byte came before the digest was checked (%v)", err)
	case <-time.After(200 * time.Millisecond):
	}
	if err := sp.verify(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := <-last; err != nil || !bytes.Equal(got, blob) {
		t.Fatalf("after the check: %v, equal %v", err, bytes.Equal(got, blob))
	}
}

// A blob that does not match its digest is broken off one byte short: the
// client sees the connection cut, never a complete body.
func TestLoopRegistryBreaksOffCorruptBlob(t *testing.T) {
	blob := randomBytes(5000)
	sp := testSpool(t, blob, digestOf([]byte("another blob")))
	r, img, _ := testRegistry(t, sp, nil)
	resp, err := http.Get("http://" + r.Host() + "/v2/" + img.repo + "/blobs/" + sp.digest)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := sp.WriteAt(blob, 0); err != nil {
		t.Fatal(err)
	}
	verr := sp.verify(context.Background())
	if !errors.Is(verr, errDigest) {
		t.Fatalf("verify: %v", verr)
	}
	got, err := io.ReadAll(resp.Body)
	if err == nil || len(got) >= len(blob) {
		t.Fatalf("read %d of %d bytes, err %v", len(got), len(blob), err)
	}
	if !bytes.Equal(got, blob[:len(got)]) {
		t.Fatal("wrong bytes before the break")
	}
	// A later request is cut too.
	resp2, err := http.Get("http://" + r.Host() + "/v2/" + img.repo + "/blobs/" + sp.digest)
	if err == nil {
		_, err = io.ReadAll(resp2.Body)
		resp2.Body.Close()
	}
	if err == nil {
		t.Fatal("a corrupt blob served whole")
	}
}

// A fetch that fails ends every reader; a waiting reader ends with the
// registry's close.
func TestLoopRegistryFailAndClose(t *testing.T) {
	blob := randomBytes(100)
	sp := testSpool(t, blob, "")
	r, img, _ := testRegistry(t, sp, nil)
	url := "http://" + r.Host() + "/v2/" + img.repo + "/blobs/" + sp.digest
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		done <- err
	}()
	r.close()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("a closed registry ended a blob cleanly")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a reader outlived the registry's close")
	}
	sp.fail(errors.New("upstream went away"))
	if _, err := sp.readAt(context.Background(), make([]byte, 10), 0); err == nil || !strings.Contains(err.Error(), "upstream") {
		t.Fatalf("readAt after fail: %v", err)
	}
}

// A connection admit refuses is closed before any request is read.
func TestLoopRegistryAdmission(t *testing.T) {
	blob := randomBytes(10)
	sp := testSpool(t, blob, "")
	var asked atomic.Int32
	r, _, _ := testRegistry(t, sp, func(c net.Conn) (bool, string) {
		asked.Add(1)
		return false, "not root-equivalent"
	})
	_, err := http.Get("http://" + r.Host() + "/v2/")
	if err == nil || asked.Load() == 0 {
		t.Fatalf("a refused connection was served (err %v, asked %d)", err, asked.Load())
	}
}

// At most maxLoopConns connections at once; one past them is closed.
func TestLoopRegistryBoundsConnections(t *testing.T) {
	sp := testSpool(t, randomBytes(10), "")
	r, _, _ := testRegistry(t, sp, nil)
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for range maxLoopConns {
		c, err := net.Dial("tcp", r.Host())
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	// Each held connection is accepted (and holds a slot) once it has
	// sent a request line and its answer came.
	for _, c := range conns {
		if _, err := io.WriteString(c, "GET /v2/ HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := c.Read(make([]byte, 512)); err != nil {
			t.Fatalf("a connection within the bound: %v", err)
		}
	}
	extra, err := net.Dial("tcp", r.Host())
	if err != nil {
		t.Fatal(err)
	}
	defer extra.Close()
	_, _ = io.WriteString(extra, "GET /v2/ HTTP/1.1\r\nHost: x\r\n\r\n")
	extra.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := extra.Read(make([]byte, 512)); err == nil || n > 0 {
		t.Fatalf("a connection past the bound was served (%d bytes, %v)", n, err)
	}
}

func TestParseRange(t *testing.T) {
	for _, c := range []struct {
		h                string
		from, to         int64
		partial, satisfy bool
	}{
		{"", 0, 100, false, true},
		{"bytes=0-", 0, 100, true, true},
		{"bytes=10-19", 10, 20, true, true},
		{"bytes=10-1000", 10, 100, true, true},
		{"bytes=99-", 99, 100, true, true},
		{"bytes=100-", 0, 0, false, false},
		{"bytes=-10", 90, 100, true, true},
		{"bytes=-1000", 0, 100, true, true},
		{"bytes=-0", 0, 0, false, false},
		{"bytes=20-10", 0, 100, false, true},
		{"bytes=0-1,5-6", 0, 100, false, true},
		{"items=0-1", 0, 100, false, true},
		{"bytes=x-", 0, 100, false, true},
		{"bytes=+1-2", 0, 100, false, true},
		{"bytes=99999999999999999999-", 0, 100, false, true},
	} {
		from, to, partial, ok := parseRange(c.h, 100)
		if from != c.from || to != c.to || partial != c.partial || ok != c.satisfy {
			t.Errorf("%q: %d-%d partial %v ok %v", c.h, from, to, partial, ok)
		}
	}
}

// FuzzParseRange: whatever the header, the span is inside the blob, and a
// partial one is not empty.
func FuzzParseRange(f *testing.F) {
	for _, s := range []string{"", "bytes=0-", "bytes=5-9", "bytes=-3", "bytes=9-5", "bytes=1-2,3-4", "bytes= 1-2", "bytes=-", "bytes=0-0"} {
		f.Add(s, int64(10))
	}
	f.Fuzz(func(t *testing.T, h string, size int64) {
		if size <= 0 || size > maxBlob {
			return
		}
		from, to, partial, ok := parseRange(h, size)
		if !ok {
			return
		}
		if from < 0 || from > to || to > size || (partial && from == to) || (!partial && (from != 0 || to != size)) {
			t.Fatalf("%q of %d: %d-%d partial %v", h, size, from, to, partial)
		}
	})
}

// FuzzParseV2Path: a manifest or blob path is exactly the repository's,
// its reference one bounded path element.
func FuzzParseV2Path(f *testing.F) {
	repo := loopRepoPrefix + "0123456789abcdef0123456789abcdef"
	for _, s := range []string{"/v2/", "/v2", "/v2/" + repo + "/manifests/v1", "/v2/" + repo + "/blobs/sha256:ab",
		"/v2/" + repo + "/blobs/../x", "/v2/" + repo + "x/manifests/v1", "/v2/" + repo + "/manifests/", "/v2//manifests/v1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, path string) {
		kind, ref := parseV2Path(path, repo)
		switch kind {
		case pathBase:
			if path != "/v2/" && path != "/v2" {
				t.Fatalf("%q: base", path)
			}
		case pathManifest, pathBlob:
			section := "/manifests/"
			if kind == pathBlob {
				section = "/blobs/"
			}
			if ref == "" || len(ref) > maxRefLen || strings.Contains(ref, "/") || path != "/v2/"+repo+section+ref {
				t.Fatalf("%q: kind %d ref %q", path, kind, ref)
			}
		case pathOther:
			if ref != "" {
				t.Fatalf("%q: other with ref %q", path, ref)
			}
		default:
			t.Fatalf("%q: kind %d", path, kind)
		}
	})
}

// FuzzAddSpan: spans stay sorted, disjoint and apart, and cover exactly
// what was added.
func FuzzAddSpan(f *testing.F) {
	f.Add([]byte{0, 4, 8, 4, 4, 4})
	f.Add([]byte{10, 1, 0, 10, 5, 20})
	f.Fuzz(func(t *testing.T, b []byte) {
		const size = 256
		var spans []span
		var covered [size + 256]bool
		for i := 0; i+1 < len(b) && i < 64; i += 2 {
			from, n := int64(b[i]), int64(b[i+1])
			if n == 0 {
				continue
			}
			spans = addSpan(spans, span{from, from + n})
			for k := from; k < from+n; k++ {
				covered[k] = true
			}
		}
		var got [size + 256]bool
		for i, sp := range spans {
			if sp.from >= sp.to || (i > 0 && spans[i-1].to >= sp.from) {
				t.Fatalf("spans %v", spans)
			}
			for k := sp.from; k < sp.to; k++ {
				got[k] = true
			}
		}
		if got != covered {
			t.Fatalf("spans %v do not cover what was added", spans)
		}
	})
}

func TestSplitLoopRef(t *testing.T) {
	hex32 := "0123456789abcdef0123456789abcdef"
	for _, c := range []struct {
		ref string
		ok  bool
	}{
		{"127.0.0.1:4321/tandem-fastpull/" + hex32 + ":v1", true},
		{"127.0.0.1:4321/tandem-fastpull/" + hex32 + ":latest", true},
		{"127.0.0.1/tandem-fastpull/" + hex32 + ":v1", false},
		{"10.0.0.1:4321/tandem-fastpull/" + hex32 + ":v1", false},
		{"127.0.0.1:4321/tandem-fastpull/" + hex32[1:] + ":v1", false},
		{"127.0.0.1:4321/tandem-fastpull/" + strings.ToUpper(hex32) + ":v1", false},
		{"127.0.0.1:4321/tandem-fastpull/" + hex32, false},
		{"127.0.0.1:4321/other/" + hex32 + ":v1", false},
		{"127.0.0.1:4321/x/tandem-fastpull/" + hex32 + ":v1", false},
	} {
		host, repo, tag, ok := splitLoopRef(c.ref)
		if ok != c.ok || (ok && host+"/"+repo+":"+tag != c.ref) {
			t.Errorf("%s: %s %s %s %v", c.ref, host, repo, tag, ok)
		}
	}
}
