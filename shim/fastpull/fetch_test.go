package fastpull

import (
	"bytes"
	"context"
	"crypto/rand"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// blobServer serves blob at /blob with Go's Range handling; mode changes
// what it does.
type blobServer struct {
	blob    []byte
	mode    string // "", "norange", "badrange", "stallonce", "long"
	ranges  atomic.Int32
	stalled atomic.Bool
}

func (s *blobServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch s.mode {
	case "norange":
		r.Header.Del("Range")
	case "badrange":
		if r.Header.Get("Range") != "" {
			w.Header().Set("Content-Range", "bytes 0-1/2")
			w.WriteHeader(http.StatusPartialContent)
			w.Write(s.blob[:2])
			return
		}
	case "stallonce":
		if strings.HasPrefix(r.Header.Get("Range"), "bytes=4") && s.stalled.CompareAndSwap(false, true) {
			w.Header().Set("Content-Range", "bytes 4-7/10")
			w.WriteHeader(http.StatusPartialContent)
			w.Write(s.blob[4:5]) // a true byte, then silence: the retry asks for 5-7
			w.(http.Flusher).Flush()
			<-r.Context().Done()
			return
		}
	case "long":
		w.Write(append(bytes.Clone(s.blob), 'x'))
		return
	}
	if r.Header.Get("Range") != "" {
		s.ranges.Add(1)
	}
	http.ServeContent(w, r, "blob", time.Time{}, bytes.NewReader(s.blob))
}

func testFetcher(chunk int64) *fetcher {
	b := &atomic.Int64{}
	b.Store(1 << 30)
	return &fetcher{client: &http.Client{}, conns: newGate(4), chunk: chunk, idle: 300 * time.Millisecond, budget: b}
}

func fetchTo(t *testing.T, f *fetcher, url string, size int64) ([]byte, int64, error) {
	t.Helper()
	dst, err := os.Create(filepath.Join(t.TempDir(), "blob"))
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Close()
	var moved atomic.Int64
	err = f.fetch(context.Background(), url, 0, size, dst, func(n int64) { moved.Add(n) })
	b, _ := os.ReadFile(dst.Name())
	return b, moved.Load(), err
}

func TestFetch(t *testing.T) {
	blob := make([]byte, 10)
	_, _ = rand.Read(blob)
	for _, c := range []struct {
		mode    string
		ok      bool
		ranges  int32
		errPart string
	}{
		{"", true, 3, ""},          // 0-3 first, then 4-7 and 8-9 in parallel
		{"norange", true, 0, ""},   // one 200 on one connection
		{"stallonce", true, 3, ""}, // the silent range is tried again for what it lacks
		{"badrange", false, 0, "content-range"},
		{"long", false, 0, "the manifest says"},
	} {
		s := &blobServer{blob: blob, mode: c.mode}
		srv := httptest.NewServer(s)
		got, moved, err := fetchTo(t, testFetcher(4), srv.URL+"/blob", int64(len(blob)))
		srv.Close()
		if c.ok {
			if err != nil || !bytes.Equal(got, blob) || moved != int64(len(blob)) || s.ranges.Load() != c.ranges {
				t.Errorf("%q: %v, got %x want %x, moved %d, %d ranges", c.mode, err, got, blob, moved, s.ranges.Load())
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), c.errPart) {
			t.Errorf("%q: %v, want an error with %q", c.mode, err, c.errPart)
		}
	}
}

// A redirect to another host (a CDN) is followed once, its URL ranged
// against, and the registry's Authorization is not sent there.
func TestFetchRedirectDropsAuth(t *testing.T) {
	blob := make([]byte, 9)
	_, _ = rand.Read(blob)
	var mu sync.Mutex
	var cdnAuth []string
	var cdnHits int
	cdn := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		cdnAuth = append(cdnAuth, r.Header.Get("Authorization"))
		cdnHits++
		mu.Unlock()
		http.ServeContent(w, r, "blob", time.Time{}, bytes.NewReader(blob))
	}))
	defer cdn.Close()
	var regHits atomic.Int32
	reg := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		regHits.Add(1)
		if r.Header.Get("Authorization") != "Bearer t0ken" {
			http.Error(w, "no", http.StatusUnauthorized)
			return
		}
		http.Redirect(w, r, strings.Replace(cdn.URL, "127.0.0.1", "localhost", 1)+"/signed?x=1", http.StatusTemporaryRedirect)
	}))
	defer reg.Close()
	f := testFetcher(3)
	f.client.Transport = authTransport{host: strings.TrimPrefix(reg.URL, "http://")}
	got, _, err := fetchTo(t, f, reg.URL+"/blob", int64(len(blob)))
	if err != nil || !bytes.Equal(got, blob) {
		t.Fatalf("%v: %x want %x", err, got, blob)
	}
	if regHits.Load() != 1 || cdnHits != 3 {
		t.Fatalf("registry asked %d times, the CDN %d; want 1 and 3", regHits.Load(), cdnHits)
	}
	for _, a := range cdnAuth {
		if a != "" {
			t.Fatalf("the CDN got Authorization %q", a)
		}
	}
}

// authTransport adds a token for one host only, as go-containerregistry's
// transports do.
type authTransport struct{ host string }

func (a authTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.URL.Host == a.host {
		r = r.Clone(r.Context())
		r.Header.Set("Authorization", "Bearer t0ken")
	}
	return http.DefaultTransport.RoundTrip(r)
}

func TestFetchBudget(t *testing.T) {
	srv := httptest.NewServer(&blobServer{blob: make([]byte, 10)})
	defer srv.Close()
	f := testFetcher(4)
	f.budget.Store(9)
	if _, _, err := fetchTo(t, f, srv.URL+"/blob", 10); err != errBudget {
		t.Fatalf("over budget: %v", err)
	}
}
