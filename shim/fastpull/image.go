package fastpull

import (
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
	ImageTag(ctx context.Context, source, target string) error
	ImagePull(ctx context.Context, ref string, opts image.PullOptions) (io.ReadCloser, error)
	ImageRemove(ctx context.Context, ref string, opts image.RemoveOptions) ([]image.DeleteResponse, error)
	ImageList(ctx context.Context, opts image.ListOptions) ([]image.Summary, error)
}

// maxLayers bounds the layers of an image the fast path takes (Docker's
// overlay2 stops at 128).
const maxLayers = 256

// layer is one layer of the image being pulled.
type layer struct {
	i      int
	id     string // Docker's short id: 12 hex digits of the blob digest
	digest string
	diffID string
	size   int64
	sp     *spool // its temporary file as it arrives
}

// phases is where a fast pull's time went, since its start: every blob
// down and checked, Docker's pull from the loopback registry done.
type phases struct {
	start           time.Time
	fetched, pulled atomic.Int64 // ns since start
	bytes           atomic.Int64
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
	return []any{"fetched_at", s(&ph.fetched), "docker_pulled_at", s(&ph.pulled), "blob_bytes", ph.bytes.Load()}
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
		// Docker names such an image by digest (RepoDigests), which the
		// Engine API cannot give an image another registry's pull made.
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
	rawManifest, err := img.RawManifest()
	if err != nil {
		return fmt.Errorf("manifest of %s: %w", ref, err)
	}
	mediaType, err := img.MediaType()
	if err != nil {
		return fmt.Errorf("manifest of %s: %w", ref, err)
	}
	manifestDigest, err := img.Digest()
	if err != nil {
		return fmt.Errorf("manifest of %s: %w", ref, err)
	}
	repo, err := newRepoName()
	if err != nil {
		return err
	}
	p.sweepLoopRefs(ctx)
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
		conns:  newGate(p.cfg.Conns),
		chunk:  p.cfg.ChunkSize,
		idle:   p.cfg.IdleTimeout,
		budget: budget,
	}
	repoURL := fmt.Sprintf("%s://%s/v2/%s/blobs/", reg.Scheme(), reg.RegistryStr(), tag.Context().RepositoryStr())

	// Every layer has a spool the loopback registry serves; those Docker
	// lacks are fetched now, any other once Docker asks for it.
	var (
		wg      sync.WaitGroup
		startMu sync.Mutex // guards stopped and wg's Add
		stopped bool
	)
	blobs := make(map[string]blobSource, len(layers))
	ids := make(map[string]bool, len(layers))
	for _, l := range layers {
		if src, dup := blobs[l.digest]; dup { // one blob twice in the image
			l.sp = src.sp
			continue
		}
		file, err := os.OpenFile(filepath.Join(dir, fmt.Sprintf("%d.blob", l.i)), os.O_CREATE|os.O_RDWR|os.O_EXCL, 0o600)
		if err != nil {
			return fmt.Errorf("temporary blob: %w", err)
		}
		defer file.Close()
		l.sp = newSpool(file, l.size, l.digest)
		var once sync.Once
		start := func() {
			once.Do(func() {
				startMu.Lock()
				defer startMu.Unlock()
				if stopped {
					return
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					if err := p.layer(ctx, f, repoURL, l, prog, ph); err != nil {
						cancel(err)
					}
				}()
			})
		}
		blobs[l.digest] = blobSource{sp: l.sp, start: start}
		ids[l.id] = true
	}
	lr, err := startLoopRegistry(ctx, loopImage{
		repo: repo, tag: tag.TagStr(), manifest: rawManifest, mediaType: string(mediaType),
		manifestDigest: manifestDigest.String(), config: rawCfg, configDigest: imageID, blobs: blobs,
	}, p.cfg.Admit, p.log)
	if err != nil {
		return err
	}
	defer func() {
		cancel(errors.New("the fast pull is over"))
		lr.close()
		startMu.Lock()
		stopped = true
		startMu.Unlock()
		wg.Wait()
	}()
	if !dockerInsecure(ctx, info, lr.Host()) {
		return unsupported("Docker does not take %s as a plain-HTTP registry", lr.Host())
	}
	for _, l := range layers[have:] {
		blobs[l.digest].start()
	}
	loopRef := lr.Ref()
	// A loopback name Docker's pull left behind goes whatever happens next.
	defer p.dropLoopRef(ctx, loopRef)
	if err := p.dockerPull(ctx, loopRef, ids, prog); err != nil {
		cancel(err)
		return cmpErr(context.Cause(ctx), err)
	}
	ph.mark(&ph.pulled)
	if err := p.adopt(ctx, loopRef, ref, imageID); err != nil {
		return err
	}
	if p.cfg.Loaded != nil {
		if err := p.cfg.Loaded(imageID); err != nil {
			p.log.Warn("image pulled but not recorded as the shim's: image GC leaves it", "image", imageID, "err", err)
		}
	}
	prog.status("", "Digest: "+manifestDigest.String())
	prog.status("", "Status: Downloaded newer image for "+ref)
	return nil
}

// cmpErr prefers the pull's first cause (a layer's failure) over the
// error of Docker's pull it caused.
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
		switch d.MediaType {
		case types.DockerLayer, types.OCILayer, types.OCIUncompressedLayer, "application/vnd.docker.image.rootfs.diff.tar":
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
// already, by chain ID in its layer store: those are fetched only if
// Docker's pull asks the loopback registry for them (Docker skips a layer
// it has when it knows the blob's digest, which a layer that came by a
// load lacks).
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

// layer fetches one layer blob into its spool and checks it against its
// digest as it arrives; the loopback registry serves the spool meanwhile.
func (p *Puller) layer(ctx context.Context, f *fetcher, repoURL string, l *layer, prog *progress, ph *phases) error {
	verified := make(chan error, 1)
	go func() { verified <- l.sp.verify(ctx) }()
	var got atomic.Int64
	prog.count(l.id, "Downloading", 0, l.size, true)
	err := f.fetch(ctx, repoURL+l.digest, l.i, l.size, l.sp, func(n int64) {
		prog.count(l.id, "Downloading", got.Add(n), l.size, false)
	})
	if err != nil {
		err = fmt.Errorf("layer %s: %w", l.digest, err)
		l.sp.fail(err)
		<-verified
		return err
	}
	if err := <-verified; err != nil {
		return fmt.Errorf("layer %s: %w", l.digest, err)
	}
	prog.count(l.id, "Downloading", l.size, l.size, true)
	prog.status(l.id, "Download complete")
	ph.mark(&ph.fetched)
	ph.bytes.Add(l.size)
	return nil
}
