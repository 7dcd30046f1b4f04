package e2e

import (
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/e2e/testenv"
)

// regProxy stands between Docker (or the shim) and a real registry to
// make it behave as registries and CDNs out there do: refuse Range,
// corrupt blobs, and count what it serves.
type regProxy struct {
	addr string
	// noRange drops every request's Range header: the registry answers
	// 200 with the whole blob, as a CDN that does not range.
	noRange atomic.Bool
	// corrupt flips a byte of every blob body: all of them, or only the
	// ranged ones (what the fast path asks; Docker's pull asks none).
	corrupt, corruptRanged atomic.Bool

	mu        sync.Mutex
	partial   int              // 206 answers
	blobBytes map[string]int64 // bytes of each blob path served
	manifests int              // manifest GETs by tag
}

func startRegProxy(t *testing.T, upstream string) *regProxy {
	t.Helper()
	p := &regProxy{blobBytes: map[string]int64{}}
	u, _ := url.Parse("http://" + upstream)
	rp := httputil.NewSingleHostReverseProxy(u)
	rp.ModifyResponse = func(resp *http.Response) error {
		path := resp.Request.URL.Path
		if resp.Request.Method != http.MethodGet {
			return nil
		}
		if strings.Contains(path, "/manifests/") && !strings.Contains(path, "sha256:") {
			p.mu.Lock()
			p.manifests++
			p.mu.Unlock()
		}
		if !strings.Contains(path, "/blobs/sha256:") || resp.StatusCode/100 != 2 {
			return nil
		}
		ranged := resp.StatusCode == http.StatusPartialContent
		p.mu.Lock()
		if ranged {
			p.partial++
		}
		p.mu.Unlock()
		flip := p.corrupt.Load() || (ranged && p.corruptRanged.Load())
		resp.Body = &countBody{ReadCloser: resp.Body, flip: flip, add: func(n int64) {
			p.mu.Lock()
			p.blobBytes[path] += n
			p.mu.Unlock()
		}}
		return nil
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if p.noRange.Load() {
			r.Header.Del("Range")
		}
		rp.ServeHTTP(w, r)
	})}
	p.addr = testenv.FreeAddr(t)
	testenv.RemoveImagesFrom(t, p.addr)
	ln, err := netListen(p.addr)
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return p
}

// served is the most bytes served of one blob.
func (p *regProxy) served() (partial int, most int64, manifests int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, n := range p.blobBytes {
		most = max(most, n)
	}
	return p.partial, most, p.manifests
}

type countBody struct {
	io.ReadCloser
	flip    bool
	flipped bool
	add     func(int64)
}

func (c *countBody) Read(b []byte) (int, error) {
	n, err := c.ReadCloser.Read(b)
	if n > 0 && c.flip && !c.flipped {
		b[0] ^= 0xff
		c.flipped = true
	}
	c.add(int64(n))
	return n, err
}

// bigImage builds an image over busybox with two fresh random layers
// (what a pull must fetch): sizes in bytes.
func bigImage(t *testing.T, a, b int) string {
	t.Helper()
	blobA, blobB := make([]byte, a), make([]byte, b)
	_, _ = rand.Read(blobA)
	_, _ = rand.Read(blobB)
	return buildImage(t, "fast", map[string][]byte{"a": blobA, "b": blobB,
		"Dockerfile": fmt.Appendf(nil, "FROM %s\nCOPY a /a\nCOPY b /b\n", testenv.Busybox(t))})
}

func shimLog(t *testing.T, h *shimHarness) string {
	t.Helper()
	b, err := os.ReadFile(h.log)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// inspect is ref's image's fields in format.
func inspect(t *testing.T, ref, format string) string {
	t.Helper()
	out, err := testenv.Docker(context.Background(), "image", "inspect", "--format", format, ref)
	if err != nil {
		t.Fatalf("inspect %s: %v", ref, err)
	}
	return strings.TrimSpace(out)
}

// repoDigests is the RepoDigests of ref's image, as JSON.
func repoDigests(t *testing.T, ref string) string {
	return inspect(t, ref, "{{json .RepoDigests}}")
}

// noLoopbackName checks that ref's image has no name of a fast pull's
// loopback registry, by tag or digest: the shim removes it once the image
// is ref.
func noLoopbackName(t *testing.T, ref string) {
	t.Helper()
	if out := inspect(t, ref, "{{json .RepoTags}} {{json .RepoDigests}}"); strings.Contains(out, "tandem-fastpull/") {
		t.Fatalf("%s keeps a loopback registry's name: %s", ref, out)
	}
}

func imageID(t *testing.T, ref string) string {
	return inspect(t, ref, "{{.Id}} {{json .RepoTags}}")
}

// The fast path over ranged requests with basic auth gives the image
// Docker's own pull gives: the same ID, the tag asked for.
func TestFastPullIsDockersImage(t *testing.T) {
	t.Parallel()
	reg := testenv.StartRegistry(t)
	reg.Push(t, bigImage(t, 6<<20, 3<<20), "tandem/fast:v1")
	px := startRegProxy(t, reg.Addr)
	ref := px.addr + "/tandem/fast:v1"
	h := startShim(t, runnerScript(t, `test -f /a && test -f /b && exit 0; exit 9`), nil, "--image-fast-pull", "--image-fast-pull-loopback", "--image-fast-pull-chunk-size", "1048576")
	// What a shim killed mid-pull leaves: a loopback name no registry
	// serves any more. The next fast pull removes it.
	stale := "127.0.0.1:1/tandem-fastpull/" + strings.Repeat("0f", 16) + ":stale"
	if _, err := testenv.Docker(context.Background(), "tag", testenv.Busybox(t), stale); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = testenv.Docker(context.Background(), "rmi", stale) })

	task := h.submit(api.TaskConfig{ImageName: ref, RegistryUsername: reg.Username, RegistryPassword: reg.Password})
	info := h.wait(task.ID, 2*time.Minute, terminated)
	if info.TerminationReason != api.ReasonDoneByRunner {
		t.Fatalf("task: %+v\n%s", info, shimLog(t, h))
	}
	// docker_pulled_at: Docker's pull from the shim's loopback registry.
	if log := shimLog(t, h); !strings.Contains(log, "image pulled by the fast path") || !strings.Contains(log, "docker_pulled_at") ||
		strings.Contains(log, "Docker pulls instead") || strings.Contains(log, "loopback registry refused") {
		t.Fatalf("the fast path did not pull:\n%s", log)
	}
	if _, err := testenv.Docker(context.Background(), "image", "inspect", stale); err == nil {
		t.Fatalf("the stale loopback name %s is left", stale)
	}
	if partial, _, _ := px.served(); partial < 6 {
		t.Fatalf("%d ranged answers for a 6 MiB and a 3 MiB layer in 1 MiB ranges", partial)
	}
	if p := info.ImagePullProgress; p == nil || p.TotalBytes < 9<<20 || p.DownloadedBytes != p.TotalBytes || !p.IsTotalBytesFinal {
		t.Fatalf("pull progress: %+v", p)
	}
	fast := imageID(t, ref)
	if !strings.Contains(fast, `["`+ref+`"]`) {
		t.Fatalf("RepoTags after the fast pull: %s", fast)
	}
	// Docker pulled it from the shim's loopback registry, whose name is
	// gone, its digest reference with it (as after ImageLoad: the ledger
	// of images the shim put in Docker tells image GC it may go).
	noLoopbackName(t, ref)
	if d := repoDigests(t, ref); d != "[]" {
		t.Fatalf("RepoDigests after the fast pull: %s", d)
	}
	if ledger, err := os.ReadFile(filepath.Join(h.home, "images-loaded")); err != nil || !strings.Contains(string(ledger), strings.Fields(fast)[0]) {
		t.Fatalf("the image GC ledger (%v): %q lacks %s", err, ledger, strings.Fields(fast)[0])
	}
	// Docker's own pull of the same image, from nothing.
	ctx := context.Background()
	cfg := t.TempDir()
	for _, n := range h.names {
		_, _ = testenv.Docker(ctx, "rm", "-f", n)
	}
	if _, err := testenv.Docker(ctx, "rmi", ref); err != nil {
		t.Fatal(err)
	}
	if _, err := testenv.Docker(ctx, "--config", cfg, "login", "-u", reg.Username, "-p", reg.Password, px.addr); err != nil {
		t.Fatal(err)
	}
	if _, err := testenv.Docker(ctx, "--config", cfg, "pull", ref); err != nil {
		t.Fatal(err)
	}
	if docker := imageID(t, ref); docker != fast {
		t.Fatalf("fast path %s, docker pull %s", fast, docker)
	}
}

// A registry that refuses Range is fetched on one connection, still by
// the fast path; one that sends a corrupt blob is refused, and Docker's
// pull decides (here it gets the whole blob, which is intact).
func TestFastPullRangeRefusedAndCorruptBlob(t *testing.T) {
	t.Parallel()
	reg := testenv.StartRegistry(t)
	reg.Push(t, bigImage(t, 4<<20, 2<<20), "tandem/norange:v1")
	reg.Push(t, bigImage(t, 4<<20, 2<<20), "tandem/corrupt:v1")
	reg.Push(t, bigImage(t, 1<<20, 1<<20), "tandem/bad:v1")
	px := startRegProxy(t, reg.Addr)
	h := startShim(t, runnerScript(t, `exit 0`), nil, "--image-fast-pull", "--image-fast-pull-loopback", "--image-fast-pull-chunk-size", "1048576")
	run := func(repo string) (api.TaskInfoResponse, string) {
		task := h.submit(api.TaskConfig{ImageName: px.addr + "/" + repo, RegistryUsername: reg.Username, RegistryPassword: reg.Password})
		return h.wait(task.ID, 2*time.Minute, terminated), px.addr + "/" + repo
	}

	px.noRange.Store(true)
	info, _ := run("tandem/norange:v1")
	px.noRange.Store(false)
	log := shimLog(t, h)
	if info.TerminationReason != api.ReasonDoneByRunner || !strings.Contains(log, "image pulled by the fast path") || strings.Contains(log, "Docker pulls instead") {
		t.Fatalf("no Range: %+v\n%s", info, log)
	}
	if partial, _, _ := px.served(); partial != 0 {
		t.Fatalf("%d ranged answers with Range refused", partial)
	}

	px.corruptRanged.Store(true)
	info, ref := run("tandem/corrupt:v1")
	px.corruptRanged.Store(false)
	log = shimLog(t, h)
	if info.TerminationReason != api.ReasonDoneByRunner || !strings.Contains(log, "Docker pulls instead") || !strings.Contains(log, "digest mismatch") {
		t.Fatalf("corrupt ranges: %+v\n%s", info, log)
	}
	if !strings.Contains(imageID(t, ref), ref) {
		t.Fatalf("after the fallback: %s", imageID(t, ref))
	}
	// The blob was broken off before Docker held it whole: Docker's pull
	// from the loopback registry left no name behind.
	noLoopbackName(t, ref)

	// Corrupt for Docker too: the task fails as Docker's pull decides.
	px.corrupt.Store(true)
	info, _ = run("tandem/bad:v1")
	if info.TerminationReason != api.ReasonCreatingContainerError || !strings.HasPrefix(info.TerminationMessage, "pullImage error:") {
		t.Fatalf("corrupt blob: %+v", info)
	}
	if n := strings.Count(shimLog(t, h), "Docker pulls instead"); n != 2 {
		t.Fatalf("%d fallback log lines, want 2", n)
	}
}

// Two tasks of one image at once: one pull, each task sees it complete,
// and the image is the one Docker's pull makes. The deprecated
// --image-fast-pull-inflate is still accepted (and does nothing).
func TestFastPullTwoTasksOnePull(t *testing.T) {
	t.Parallel()
	reg := testenv.StartRegistry(t)
	reg.Push(t, bigImage(t, 8<<20, 1<<20), "tandem/twice:v1")
	px := startRegProxy(t, reg.Addr)
	ref := px.addr + "/tandem/twice:v1"
	h := startShim(t, runnerScript(t, `exit 0`), nil, "--image-fast-pull", "--image-fast-pull-loopback", "--image-fast-pull-inflate")
	a := h.submit(api.TaskConfig{ImageName: ref, RegistryUsername: reg.Username, RegistryPassword: reg.Password})
	b := h.submit(api.TaskConfig{ImageName: ref, RegistryUsername: reg.Username, RegistryPassword: reg.Password})
	for _, id := range []string{a.ID, b.ID} {
		if info := h.wait(id, 2*time.Minute, terminated); info.TerminationReason != api.ReasonDoneByRunner {
			t.Fatalf("task %s: %+v\n%s", id, info, shimLog(t, h))
		}
	}
	_, most, manifests := px.served()
	if most > 8<<20+1<<20 || manifests != 1 {
		t.Fatalf("largest blob served %d bytes (one layer is 8 MiB of random bytes), %d manifest GETs\n%s", most, manifests, shimLog(t, h))
	}
	if n := strings.Count(shimLog(t, h), "image pulled by the fast path"); n != 1 {
		t.Fatalf("%d fast pulls, want 1", n)
	}
	fast := imageID(t, ref)
	ctx := context.Background()
	for _, n := range h.names {
		_, _ = testenv.Docker(ctx, "rm", "-f", n)
	}
	if _, err := testenv.Docker(ctx, "rmi", ref); err != nil {
		t.Fatal(err)
	}
	cfg := t.TempDir()
	if _, err := testenv.Docker(ctx, "--config", cfg, "login", "-u", reg.Username, "-p", reg.Password, px.addr); err != nil {
		t.Fatal(err)
	}
	if _, err := testenv.Docker(ctx, "--config", cfg, "pull", ref); err != nil {
		t.Fatal(err)
	}
	if docker := imageID(t, ref); docker != fast {
		t.Fatalf("fast path %s, docker pull %s", fast, docker)
	}
}

// The cold registry (TLS with a CA Docker trusts through certs.d, a
// capped link): the fast path fetches over ranges with basic auth, the
// image is the one Docker's pull would give (its ID is the config's
// digest), and a registry that stops sending ends in the stall timeout.
// Its token server, on another private address than the registry's, is a
// realm go-containerregistry refuses (SSRF guard): Docker's pull does it.
func TestFastPullColdRegistryAuthKindsAndStall(t *testing.T) {
	t.Parallel()
	reg := testenv.StartColdRegistry(t, testenv.ColdOptions{Auth: testenv.AuthBasic})
	tokenReg := testenv.StartColdRegistry(t, testenv.ColdOptions{Auth: testenv.AuthToken})
	img := testenv.BuildColdImage(t, testenv.ColdSmall)
	ref := reg.AddImage(t, img, "tandem/cold:v1")
	stallRef := reg.AddImage(t, img, "tandem/cold-stall:v1")
	tokenRef := tokenReg.AddImage(t, img, "tandem/cold-token:v1")
	h := startShim(t, runnerScript(t, `exit 0`), nil, "--image-fast-pull", "--image-fast-pull-chunk-size", "4194304", "--pull-stall-timeout", "20s")
	rmImage := func(ref string) {
		for _, n := range h.names {
			_, _ = testenv.Docker(context.Background(), "rm", "-f", n)
		}
		if _, err := testenv.Docker(context.Background(), "rmi", ref); err != nil {
			t.Fatal(err)
		}
	}

	task := h.submit(api.TaskConfig{ImageName: ref, RegistryUsername: reg.Username, RegistryPassword: reg.Password})
	info := h.wait(task.ID, 3*time.Minute, terminated)
	log := shimLog(t, h)
	if info.TerminationReason != api.ReasonDoneByRunner || !strings.Contains(log, "image pulled by the fast path") || strings.Contains(log, "Docker pulls instead") {
		t.Fatalf("basic auth over TLS: %+v\n%s", info, log)
	}
	if st := reg.Stats(); st.RangedGets < 4 {
		t.Fatalf("served: %+v", st)
	}
	if got := imageID(t, ref); !strings.HasPrefix(got, img.ConfigDigest+" ") {
		t.Fatalf("image %s, the config's digest is %s", got, img.ConfigDigest)
	}
	rmImage(ref)

	task = h.submit(api.TaskConfig{ImageName: tokenRef, RegistryUsername: tokenReg.Username, RegistryPassword: tokenReg.Password})
	info = h.wait(task.ID, 3*time.Minute, terminated)
	log = shimLog(t, h)
	if info.TerminationReason != api.ReasonDoneByRunner || !strings.Contains(log, "Docker pulls instead") || !strings.Contains(log, "private or link-local") {
		t.Fatalf("token auth: %+v\n%s", info, log)
	}
	if got := imageID(t, tokenRef); !strings.HasPrefix(got, img.ConfigDigest+" ") {
		t.Fatalf("image %s, the config's digest is %s", got, img.ConfigDigest)
	}
	rmImage(tokenRef)

	reg.SetFaults(testenv.Faults{StallAfter: 1 << 20})
	task = h.submit(api.TaskConfig{ImageName: stallRef, RegistryUsername: reg.Username, RegistryPassword: reg.Password})
	info = h.wait(task.ID, 2*time.Minute, terminated)
	if info.TerminationReason != api.ReasonCreatingContainerError || !strings.Contains(info.TerminationMessage, "no progress for") {
		t.Fatalf("stalled registry: %+v\n%s", info, shimLog(t, h))
	}
}
