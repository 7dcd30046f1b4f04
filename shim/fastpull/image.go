package fastpull

import (
	"archive/tar"
	"bufio"
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/image"
	"github.com/docker/docker/api/types/system"
	"github.com/docker/docker/client"
	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/tandem-run/tandem/shim/task"
)

// Docker is what the fast path needs from the engine.
type Docker interface {
	Info(ctx context.Context) (system.Info, error)
	ImageInspect(ctx context.Context, ref string, opts ...client.ImageInspectOption) (image.InspectResponse, error)
	ImageLoad(ctx context.Context, input io.Reader, opts ...client.ImageLoadOption) (image.LoadResponse, error)
	ImageTag(ctx context.Context, source, target string) error
}

// maxLayers bounds the layers of an image the fast path takes (Docker's
// overlay2 stops at 128).
const maxLayers = 256

// layer is one layer of the image being pulled.
type layer struct {
	i       int
	id      string // Docker's short id: 12 hex digits of the blob digest
	digest  string
	diffID  string
	size    int64
	gzipped bool
	// pass: the blob goes to Docker as it came (Docker inflates it, and
	// checks its diff_id, as in its own pull): one layer to fetch has no
	// other layer to inflate beside it, and inflating it here would only
	// write it once more.
	pass     bool
	blob     string // compressed file
	tarPath  string // inflated file
	inflated chan struct{}
}

// phases is where a fast pull's time went, since its start: every blob
// down, every layer inflated, the archive sent to Docker, Docker done.
type phases struct {
	start                               time.Time
	fetched, inflated, streamed, loaded atomic.Int64 // ns since start
	bytes                               atomic.Int64
}

func (ph *phases) mark(at *atomic.Int64) {
	d := int64(time.Since(ph.start))
	for {
		old := at.Load()
		if d <= old || at.CompareAndSwap(old, d) {
			return
		}
	}
}

func (ph *phases) logArgs() []any {
	s := func(a *atomic.Int64) string { return time.Duration(a.Load()).Round(10 * time.Millisecond).String() }
	return []any{"fetched_at", s(&ph.fetched), "inflated_at", s(&ph.inflated), "streamed_at", s(&ph.streamed), "loaded_at", s(&ph.loaded), "blob_bytes", ph.bytes.Load()}
}

// fast pulls ref itself; any error means Docker's pull should be tried.
func (p *Puller) fast(ctx context.Context, h *hub, ref string, auth task.RegistryAuth, ph *phases) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	prog := newProgress(h, p.now)
	parsed, err := name.ParseReference(ref)
	if err != nil {
		return unsupported("reference %q: %v", ref, err)
	}
	tag, ok := parsed.(name.Tag)
	if !ok {
		// Docker names such an image by digest (RepoDigests), which a load cannot.
		return unsupported("a digest reference")
	}
	info, err := p.docker.Info(ctx)
	if err != nil {
		return fmt.Errorf("docker info: %w", err)
	}
	if info.HTTPProxy != "" || info.HTTPSProxy != "" {
		return unsupported("Docker pulls through a proxy")
	}
	host := tag.RegistryStr()
	if rc := info.RegistryConfig; host == name.DefaultRegistry && rc != nil && len(rc.Mirrors) > 0 {
		return unsupported("Docker Hub mirrors are configured")
	}
	if !p.cfg.Loopback && loopback(ctx, host) {
		return unsupported("a registry on this machine (no link to beat)")
	}
	insecure := dockerInsecure(ctx, info, host)
	var opts []name.Option
	if insecure {
		opts = append(opts, name.Insecure)
	}
	if tag, err = name.NewTag(ref, opts...); err != nil {
		return unsupported("reference %q: %v", ref, err)
	}
	reg := tag.Context().Registry
	base, err := baseTransport(p.cfg.CertsDir, host, insecure, p.cfg.Conns)
	if err != nil {
		return err
	}
	defer base.CloseIdleConnections()
	ch, err := transport.Ping(ctx, reg, base)
	if err != nil {
		return fmt.Errorf("registry %s: %w", host, err)
	}
	if ch.Insecure && !insecure {
		return unsupported("registry %s answers on http only and Docker takes it as secure", host)
	}
	var authr authn.Authenticator = authn.Anonymous
	if auth.Username != "" || auth.Password != "" {
		authr = authn.FromConfig(authn.AuthConfig{Username: auth.Username, Password: auth.Password})
	}
	rt, err := transport.NewWithContext(ctx, reg, authr, base, []string{tag.Context().Scope(transport.PullScope)})
	if err != nil {
		return fmt.Errorf("registry %s auth: %w", host, err)
	}
	plat := v1.Platform{OS: cmp.Or(info.OSType, "linux"), Architecture: runtime.GOARCH}
	desc, err := remote.Get(tag, remote.WithTransport(rt), remote.WithContext(ctx), remote.WithPlatform(plat))
	if err != nil {
		return fmt.Errorf("manifest of %s: %w", ref, err)
	}
	if !desc.MediaType.IsImage() && !desc.MediaType.IsIndex() {
		return unsupported("manifest type %s", desc.MediaType)
	}
	img, err := desc.Image()
	if err != nil {
		return fmt.Errorf("image of %s for %s/%s: %w", ref, plat.OS, plat.Architecture, err)
	}
	m, err := img.Manifest()
	if err != nil {
		return fmt.Errorf("manifest of %s: %w", ref, err)
	}
	rawCfg, err := img.RawConfigFile() // checked against its digest
	if err != nil {
		return fmt.Errorf("config of %s: %w", ref, err)
	}
	cfgName, err := img.ConfigName()
	if err != nil {
		return fmt.Errorf("config of %s: %w", ref, err)
	}
	if cfgName.String() != m.Config.Digest.String() {
		return fmt.Errorf("config of %s: %w", ref, errDigest)
	}
	var cfg struct {
		RootFS struct {
			Type    string   `json:"type"`
			DiffIDs []string `json:"diff_ids"`
		} `json:"rootfs"`
	}
	if err := json.Unmarshal(rawCfg, &cfg); err != nil {
		return unsupported("config of %s: %v", ref, err)
	}
	layers, err := planLayers(m, cfg.RootFS.DiffIDs)
	if err != nil {
		return err
	}
	imageID := cfgName.String()

	prog.status(tag.TagStr(), "Pulling from "+tag.Context().RepositoryStr())
	// The image is here already (a re-pull of latest that did not move, or
	// the same image under another name): name it, as Docker's pull would.
	if done, err := p.alreadyHere(ctx, ref, imageID, prog); done || err != nil {
		return err
	}
	have := p.presentLayers(info, layers)
	for _, l := range layers[:have] {
		prog.status(l.id, "Already exists")
	}
	todo := layers[have:]
	dir, err := os.MkdirTemp(p.cfg.TempDir, "pull-")
	if err != nil {
		return fmt.Errorf("temporary dir: %w", err)
	}
	defer os.RemoveAll(dir)
	budget := &atomic.Int64{}
	budget.Store(tempBudget(dir))
	f := &fetcher{
		client: &http.Client{Transport: rt, CheckRedirect: func(req *http.Request, via []*http.Request) error {
			if len(via) > 5 {
				return errors.New("more than 5 redirects")
			}
			return nil
		}},
		conns:  make(chan struct{}, p.cfg.Conns),
		chunk:  p.cfg.ChunkSize,
		idle:   p.cfg.IdleTimeout,
		budget: budget,
	}
	for _, l := range todo {
		prog.status(l.id, "Pulling fs layer")
	}
	for _, l := range todo {
		l.pass = len(todo) == 1 || !p.cfg.Inflate
	}
	repoURL := fmt.Sprintf("%s://%s/v2/%s/blobs/", reg.Scheme(), reg.RegistryStr(), tag.Context().RepositoryStr())
	slots := make(chan struct{}, p.cfg.Inflaters)
	var wg sync.WaitGroup
	for _, l := range todo {
		l.blob = filepath.Join(dir, fmt.Sprintf("%d.blob", l.i))
		l.tarPath = filepath.Join(dir, fmt.Sprintf("%d.tar", l.i))
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := p.layer(ctx, f, repoURL, l, slots, prog, ph); err != nil {
				cancel(err)
			}
		}()
	}
	defer wg.Wait()
	if err := p.load(ctx, ref, rawCfg, imageID, layers, have, prog, ph); err != nil {
		cancel(err)
		wg.Wait()
		return cmpErr(context.Cause(ctx), err)
	}
	// The identity check: the image Docker now names ref is the one asked.
	got, err := p.docker.ImageInspect(ctx, ref)
	if err != nil {
		return fmt.Errorf("inspect %s after the load: %w", ref, err)
	}
	if got.ID != imageID {
		return fmt.Errorf("after the load %s is %s, not %s", ref, got.ID, imageID)
	}
	if p.cfg.Loaded != nil {
		if err := p.cfg.Loaded(imageID); err != nil {
			p.log.Warn("image loaded but not recorded as the shim's: image GC leaves it", "image", imageID, "err", err)
		}
	}
	for _, l := range todo {
		prog.status(l.id, "Pull complete")
	}
	prog.status("", "Digest: "+m.Config.Digest.String())
	prog.status("", "Status: Downloaded newer image for "+ref)
	return nil
}

// cmpErr prefers the pull's first cause (a layer's failure) over the
// load's error it caused.
func cmpErr(cause, err error) error {
	if cause != nil && !errors.Is(cause, context.Canceled) {
		return cause
	}
	return err
}

// planLayers checks the manifest's layers against the config's diff_ids
// and that each is a layer Docker loads (tar, gzip tar, nothing foreign).
func planLayers(m *v1.Manifest, diffIDs []string) ([]*layer, error) {
	if len(m.Layers) != len(diffIDs) {
		return nil, unsupported("%d layers and %d diff_ids", len(m.Layers), len(diffIDs))
	}
	if len(m.Layers) == 0 || len(m.Layers) > maxLayers {
		return nil, unsupported("%d layers", len(m.Layers))
	}
	var out []*layer
	for i, d := range m.Layers {
		var gz bool
		switch d.MediaType {
		case types.DockerLayer, types.OCILayer:
			gz = true
		case types.OCIUncompressedLayer, "application/vnd.docker.image.rootfs.diff.tar":
		default:
			return nil, unsupported("layer media type %s", d.MediaType)
		}
		if len(d.URLs) > 0 {
			return nil, unsupported("a foreign layer")
		}
		if d.Digest.Algorithm != "sha256" || len(d.Digest.Hex) != 64 || !isHex(d.Digest.Hex) {
			return nil, unsupported("layer digest %s", d.Digest)
		}
		diff := diffIDs[i]
		if !strings.HasPrefix(diff, "sha256:") || len(diff) != 71 || !isHex(diff[7:]) {
			return nil, unsupported("diff_id %q", diff)
		}
		if d.Size <= 0 || d.Size > maxBlob {
			return nil, unsupported("layer size %d", d.Size)
		}
		out = append(out, &layer{
			i: i, id: d.Digest.Hex[:12], digest: d.Digest.String(), diffID: diff, size: d.Size,
			gzipped: gz, inflated: make(chan struct{}),
		})
	}
	return out, nil
}

func isHex(s string) bool {
	_, err := hex.DecodeString(s)
	return err == nil && strings.ToLower(s) == s
}

// alreadyHere names the local image imageID ref, if it is here.
func (p *Puller) alreadyHere(ctx context.Context, ref, imageID string, prog *progress) (bool, error) {
	_, err := p.docker.ImageInspect(ctx, imageID)
	if cerrdefs.IsNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("inspect %s: %w", imageID, err)
	}
	if err := p.docker.ImageTag(ctx, imageID, ref); err != nil {
		return false, fmt.Errorf("tag %s as %s: %w", imageID, ref, err)
	}
	prog.status("", "Status: Image is up to date for "+ref)
	return true, nil
}

// presentLayers is how many of the image's first layers Docker holds
// already, by chain ID in its layer store (a load skips those; had one
// gone in between, the load fails and Docker's pull is tried).
func (p *Puller) presentLayers(info system.Info, layers []*layer) int {
	if info.DockerRootDir == "" || info.Driver == "" {
		return 0
	}
	store := filepath.Join(info.DockerRootDir, "image", info.Driver, "layerdb", "sha256")
	chain := ""
	n := 0
	for _, l := range layers {
		if chain == "" {
			chain = l.diffID
		} else {
			s := sha256.Sum256([]byte(chain + " " + l.diffID))
			chain = "sha256:" + hex.EncodeToString(s[:])
		}
		if _, err := os.Stat(filepath.Join(store, chain[7:], "diff")); err != nil {
			break
		}
		n++
	}
	return n
}

// layer fetches one layer and inflates it, the inflate in one of slots.
func (p *Puller) layer(ctx context.Context, f *fetcher, repoURL string, l *layer, slots chan struct{}, prog *progress, ph *phases) error {
	blob, err := os.OpenFile(l.blob, os.O_CREATE|os.O_RDWR|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("temporary blob: %w", err)
	}
	defer blob.Close()
	var got atomic.Int64
	prog.count(l.id, "Downloading", 0, l.size, true)
	err = f.fetch(ctx, repoURL+l.digest, l.size, blob, func(n int64) {
		prog.count(l.id, "Downloading", got.Add(n), l.size, false)
	})
	if err != nil {
		return fmt.Errorf("layer %s: %w", l.digest, err)
	}
	prog.count(l.id, "Downloading", l.size, l.size, true)
	prog.status(l.id, "Download complete")
	ph.mark(&ph.fetched)
	ph.bytes.Add(l.size)
	select {
	case slots <- struct{}{}:
	case <-ctx.Done():
		return context.Cause(ctx)
	}
	defer func() { <-slots }()
	if _, err := blob.Seek(0, io.SeekStart); err != nil {
		return fmt.Errorf("temporary blob: %w", err)
	}
	var read atomic.Int64
	if l.pass {
		cr := &countingReader{r: blob, h: sha256.New(), moved: func(n int64) {
			prog.count(l.id, "Extracting", read.Add(n), l.size, false)
		}}
		if _, err := io.Copy(io.Discard, cr); err != nil {
			return fmt.Errorf("temporary blob: %w", err)
		}
		if got := "sha256:" + hex.EncodeToString(cr.h.Sum(nil)); got != l.digest {
			return fmt.Errorf("layer %s: %w: got %s", l.digest, errDigest, got)
		}
		prog.count(l.id, "Extracting", l.size, l.size, true)
		l.tarPath = l.blob
		ph.mark(&ph.inflated)
		close(l.inflated)
		return nil
	}
	out, err := os.OpenFile(l.tarPath, os.O_CREATE|os.O_WRONLY|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("temporary layer: %w", err)
	}
	err = inflate(ctx, blob, out, l.digest, l.diffID, l.gzipped, p.pigz, f.take, func(n int64) {
		prog.count(l.id, "Extracting", read.Add(n), l.size, false)
	})
	if cerr := out.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("temporary layer: %w", cerr)
	}
	if err != nil {
		return err
	}
	prog.count(l.id, "Extracting", l.size, l.size, true)
	// The compressed copy is done with: give its room back now.
	blob.Close()
	if err := os.Remove(l.blob); err == nil {
		f.budget.Add(l.size)
	}
	ph.mark(&ph.inflated)
	close(l.inflated)
	return nil
}

// load streams the image to Docker as a docker-save archive: the config,
// each new layer's tar as soon as it is inflated and checked (in order),
// then manifest.json last, so that a pull that fails midway leaves Docker
// an archive without a manifest, which it refuses, and nothing loaded.
func (p *Puller) load(ctx context.Context, ref string, rawCfg []byte, imageID string, layers []*layer, have int, prog *progress, ph *phases) error {
	pr, pw := io.Pipe()
	type result struct {
		err error
	}
	res := make(chan result, 1)
	go func() {
		resp, err := p.docker.ImageLoad(ctx, pr, client.ImageLoadWithQuiet(false))
		if err != nil {
			pr.CloseWithError(err)
			res <- result{fmt.Errorf("docker load: %w", err)}
			return
		}
		defer resp.Body.Close()
		res <- result{readLoad(resp.Body, func() { prog.alive(layers[len(layers)-1].id) })}
	}()
	err := p.writeArchive(ctx, pw, ref, rawCfg, imageID, layers, have, prog)
	if err != nil {
		pw.CloseWithError(err)
		<-res
		return err
	}
	pw.Close()
	ph.mark(&ph.streamed)
	select {
	case r := <-res:
		ph.mark(&ph.loaded)
		return r.err
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

func (p *Puller) writeArchive(ctx context.Context, w io.Writer, ref string, rawCfg []byte, imageID string, layers []*layer, have int, prog *progress) error {
	bw := bufio.NewWriterSize(w, 1<<20)
	tw := tar.NewWriter(bw)
	cfgFile := imageID[7:] + ".json"
	if err := writeEntry(tw, cfgFile, rawCfg); err != nil {
		return err
	}
	manifest := []struct {
		Config   string
		RepoTags []string
		Layers   []string
	}{{Config: cfgFile, RepoTags: []string{ref}}}
	for _, l := range layers {
		manifest[0].Layers = append(manifest[0].Layers, fmt.Sprintf("%d/layer.tar", l.i))
	}
	buf := make([]byte, 1<<20)
	for _, l := range layers[have:] {
		select {
		case <-l.inflated:
		case <-ctx.Done():
			return context.Cause(ctx)
		}
		if err := copyLayer(tw, l, buf, func() { prog.alive(l.id) }); err != nil {
			return err
		}
		os.Remove(l.tarPath)
	}
	mb, err := json.Marshal(manifest)
	if err != nil {
		return fmt.Errorf("manifest.json: %w", err)
	}
	if err := writeEntry(tw, "manifest.json", mb); err != nil {
		return err
	}
	if err := tw.Close(); err != nil {
		return fmt.Errorf("archive: %w", err)
	}
	if err := bw.Flush(); err != nil {
		return fmt.Errorf("archive: %w", err)
	}
	return nil
}

func writeEntry(tw *tar.Writer, name string, b []byte) error {
	if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(b)), Typeflag: tar.TypeReg, Format: tar.FormatPAX}); err != nil {
		return fmt.Errorf("archive %s: %w", name, err)
	}
	if _, err := tw.Write(b); err != nil {
		return fmt.Errorf("archive %s: %w", name, err)
	}
	return nil
}

func copyLayer(tw *tar.Writer, l *layer, buf []byte, alive func()) error {
	f, err := os.Open(l.tarPath)
	if err != nil {
		return fmt.Errorf("temporary layer: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return fmt.Errorf("temporary layer: %w", err)
	}
	name := fmt.Sprintf("%d/layer.tar", l.i)
	if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: st.Size(), Typeflag: tar.TypeReg, Format: tar.FormatPAX}); err != nil {
		return fmt.Errorf("archive %s: %w", name, err)
	}
	for {
		n, err := f.Read(buf)
		if n > 0 {
			if _, werr := tw.Write(buf[:n]); werr != nil {
				return fmt.Errorf("archive %s: %w", name, werr)
			}
			alive()
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("temporary layer: %w", err)
		}
	}
}

// readLoad reads Docker's load answer: an error line is the load's error;
// every other line is Docker at work (alive).
func readLoad(r io.Reader, alive func()) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var ev struct {
			Error       string `json:"error"`
			ErrorDetail *struct {
				Message string `json:"message"`
			} `json:"errorDetail"`
		}
		if json.Unmarshal(sc.Bytes(), &ev) != nil {
			continue
		}
		if ev.ErrorDetail != nil && ev.ErrorDetail.Message != "" {
			return fmt.Errorf("docker load: %s", ev.ErrorDetail.Message)
		}
		if ev.Error != "" {
			return fmt.Errorf("docker load: %s", ev.Error)
		}
		alive()
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("docker load answer: %w", err)
	}
	return nil
}
