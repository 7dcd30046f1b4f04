package e2e

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tandem-run/tandem/e2e/testenv"
)

// The cold registry harness (testenv.StartColdRegistry) itself: each auth
// kind pulls through the host's Docker (TLS trusted via certs.d) and
// refuses a pull without credentials; the small cold image (salted) runs
// and has the ID its config digest gives.
func TestColdRegistryAuthKinds(t *testing.T) {
	cold := testenv.BuildColdImage(t, testenv.ColdSmall)
	for _, kind := range []testenv.AuthKind{testenv.AuthNone, testenv.AuthBasic, testenv.AuthToken} {
		t.Run(kind.String(), func(t *testing.T) {
			// Salted: a layer of its own at the bottom, so every layer is
			// this pull's (the ID is the salted config's).
			img := cold.Salted(t, randomID(kind.String()))
			reg := testenv.StartColdRegistry(t, testenv.ColdOptions{Auth: kind})
			ref := reg.AddImage(t, img, "tandem/cold:v1")
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			if kind != testenv.AuthNone {
				_, err := testenv.Docker(ctx, "--config", t.TempDir(), "pull", ref)
				if err == nil || !(strings.Contains(err.Error(), "unauthorized") || strings.Contains(err.Error(), "authentication required") || strings.Contains(err.Error(), "no basic auth credentials") || strings.Contains(err.Error(), "access to the resource is denied")) {
					t.Fatalf("pull without credentials: %v", err)
				}
			}
			cfg := reg.DockerConfig(t)
			if _, err := testenv.Docker(ctx, "--config", cfg, "pull", ref); err != nil {
				t.Fatal(err)
			}
			id, err := testenv.Docker(ctx, "image", "inspect", "--format", "{{.Id}}", ref)
			if err != nil || strings.TrimSpace(id) != img.ConfigDigest {
				t.Fatalf("image ID %q (want %s): %v", id, img.ConfigDigest, err)
			}
			out, err := testenv.Docker(ctx, "run", "--rm", "--network", "none", ref, "/bin/sh", "-c", "sleep 0 && echo runs")
			if err != nil || strings.TrimSpace(out) != "runs" {
				t.Fatalf("run: %q %v", out, err)
			}
			st := reg.Stats()
			if st.BlobBytes < img.Size() || (kind == testenv.AuthToken) != (st.TokenRequests > 0) {
				t.Fatalf("stats: %+v (image %d bytes)", st, img.Size())
			}
		})
	}
}

// get fetches a blob through the front, with rng as its Range when set.
func coldGet(ctx context.Context, t *testing.T, c *http.Client, reg *testenv.ColdRegistry, digest, rng string) (*http.Response, []byte, error) {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "https://"+reg.Host+"/v2/tandem/cold/blobs/"+digest, nil)
	if rng != "" {
		req.Header.Set("Range", rng)
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp, b, err
}

func TestColdRegistryFaults(t *testing.T) {
	img := testenv.BuildColdImage(t, testenv.ColdSmall)
	reg := testenv.StartColdRegistry(t, testenv.ColdOptions{Uncapped: true})
	reg.AddImage(t, img, "tandem/cold:v1")
	layer := img.Layers[0]
	for _, l := range img.Layers {
		if l.Size > layer.Size {
			layer = l
		}
	}
	want, err := os.ReadFile(layer.Gz)
	if err != nil {
		t.Fatal(err)
	}
	c := reg.Client()
	ctx := context.Background()

	resp, b, err := coldGet(ctx, t, c, reg, layer.Digest, "bytes=100-199")
	if err != nil || resp.StatusCode != http.StatusPartialContent || string(b) != string(want[100:200]) {
		t.Fatalf("range: %v %v %d bytes", err, resp, len(b))
	}

	reg.SetFaults(testenv.Faults{RefuseRange: true})
	resp, b, err = coldGet(ctx, t, c, reg, layer.Digest, "bytes=100-199")
	if err != nil || resp.StatusCode != http.StatusOK || int64(len(b)) != layer.Size || resp.Header.Get("Accept-Ranges") != "" {
		t.Fatalf("refused range: %v %+v %d bytes", err, resp, len(b))
	}

	reg.SetFaults(testenv.Faults{Corrupt: true, CorruptAt: 1000})
	_, b, err = coldGet(ctx, t, c, reg, layer.Digest, "")
	if err != nil || int64(len(b)) != layer.Size || fmt.Sprintf("sha256:%x", sha256.Sum256(b)) == layer.Digest || b[1000] != want[1000]^0xff || string(b[1001:]) != string(want[1001:]) {
		t.Fatalf("corrupt: %v, %d bytes", err, len(b))
	}
	_, b, err = coldGet(ctx, t, c, reg, layer.Digest, "bytes=900-1099")
	if err != nil || len(b) != 200 || b[100] != want[1000]^0xff || b[99] != want[999] {
		t.Fatalf("corrupt in a range: %v, %d bytes", err, len(b))
	}

	// A stall sends what it allows, then nothing until the client goes.
	reg.SetFaults(testenv.Faults{StallAfter: 1 << 20})
	sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	start := time.Now()
	_, b, err = coldGet(sctx, t, c, reg, layer.Digest, "")
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) || len(b) != 1<<20 || time.Since(start) < 2*time.Second {
		t.Fatalf("stall: %v after %s, %d bytes", err, time.Since(start), len(b))
	}

	// Only ranged requests, only the first: a whole-blob GET passes, the
	// first ranged one is refused its range, the second is not.
	reg.SetFaults(testenv.Faults{RefuseRange: true, OnlyRanged: true, Times: 1, Digests: []string{layer.Digest}})
	reg.ResetStats()
	if resp, b, err = coldGet(ctx, t, c, reg, layer.Digest, ""); err != nil || resp.StatusCode != 200 || int64(len(b)) != layer.Size {
		t.Fatalf("whole blob: %v %v", err, resp)
	}
	if resp, _, err = coldGet(ctx, t, c, reg, layer.Digest, "bytes=0-9"); err != nil || resp.StatusCode != 200 {
		t.Fatalf("first ranged: %v %v", err, resp)
	}
	if resp, b, err = coldGet(ctx, t, c, reg, layer.Digest, "bytes=0-9"); err != nil || resp.StatusCode != 206 || len(b) != 10 {
		t.Fatalf("second ranged: %v %v", err, resp)
	}
	if st := reg.Stats(); st.BlobGets != 3 || st.RangedGets != 2 || st.Faulted != 1 {
		t.Fatalf("stats: %+v", st)
	}
}

// The link's shape: one connection at most its cap (100 Mbit/s = 12.5
// MB/s), many together more than one and at most the total (1 Gbit/s).
// Upper bounds only: a busy machine may go slower, never faster.
func TestColdRegistryLinkShaping(t *testing.T) {
	img := testenv.BuildColdImage(t, testenv.ColdSmall)
	reg := testenv.StartColdRegistry(t, testenv.ColdOptions{})
	reg.AddImage(t, img, "tandem/cold:v1")
	layer := img.Layers[0]
	for _, l := range img.Layers {
		if l.Size > layer.Size {
			layer = l
		}
	}
	ctx := context.Background()
	fetch := func(conns int) float64 {
		var wg sync.WaitGroup
		errs := make(chan error, conns)
		start := time.Now()
		for range conns {
			wg.Add(1)
			go func() {
				defer wg.Done()
				// A client each: a connection each.
				_, b, err := coldGet(ctx, t, reg.Client(), reg, layer.Digest, "")
				if err == nil && int64(len(b)) != layer.Size {
					err = fmt.Errorf("%d bytes of %d", len(b), layer.Size)
				}
				errs <- err
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatal(err)
			}
		}
		return float64(layer.Size) * float64(conns) / time.Since(start).Seconds() / 1e6
	}
	one := fetch(1)
	many := fetch(16)
	t.Logf("one connection %.1f MB/s, 16 together %.1f MB/s (layer %.1f MB)", one, many, float64(layer.Size)/1e6)
	if one > 12.5*1.1 {
		t.Errorf("one connection %.1f MB/s: above its 12.5 MB/s cap", one)
	}
	if many > 125*1.1 {
		t.Errorf("16 connections %.1f MB/s: above the 125 MB/s total", many)
	}
	if many < 2*one {
		t.Errorf("16 connections %.1f MB/s against one's %.1f: the cap is not per connection", many, one)
	}
}
