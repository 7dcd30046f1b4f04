package fastpull

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/filters"
	"github.com/docker/docker/api/types/image"
)

// dockerPull has Docker pull loopRef (the loopback registry's name of the
// image) and relays its progress for the image's layers (ids) into the
// pull's stream: what Docker does with each layer (waiting, verifying,
// extracting, complete) as Docker says it. Its "Downloading" counts are
// left out (the fetcher's, from the real registry, stand there) and so
// are the lines without a layer, which name the loopback registry. An
// error in Docker's stream is the fast path's error, never relayed: the
// task must not fail on what Docker's own pull may still do.
func (p *Puller) dockerPull(ctx context.Context, loopRef string, ids map[string]bool, prog *progress) error {
	rc, err := p.docker.ImagePull(ctx, loopRef, image.PullOptions{})
	if err != nil {
		return fmt.Errorf("docker pull from the loopback registry: %w", err)
	}
	defer rc.Close()
	return relayPull(rc, ids, prog.h)
}

// relayPull reads Docker's pull stream r into h (see dockerPull).
func relayPull(r io.Reader, ids map[string]bool, h *hub) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var ev event
		if json.Unmarshal(sc.Bytes(), &ev) != nil {
			continue
		}
		if ev.ErrorDetail != nil && ev.ErrorDetail.Message != "" {
			return fmt.Errorf("docker pull from the loopback registry: %s", ev.ErrorDetail.Message)
		}
		if ev.Error != "" {
			return fmt.Errorf("docker pull from the loopback registry: %s", ev.Error)
		}
		if !ids[ev.ID] || ev.Status == "Downloading" {
			continue
		}
		counts := ev.ProgressDetail != nil && ev.ProgressDetail.Total > 0
		h.add(append(bytes.Clone(sc.Bytes()), '\n'), counts)
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("docker pull from the loopback registry: its answer: %w", err)
	}
	return nil
}

// adopt gives the image Docker pulled as loopRef the name asked for, ref,
// and takes the loopback name away (its tag and, with it, Docker's digest
// reference of that repository; never the image), then checks ref is the
// image asked for (its ID the config's digest, as Docker's own pull from
// upstream gives) with no loopback name left.
func (p *Puller) adopt(ctx context.Context, loopRef, ref, imageID string) error {
	got, err := p.docker.ImageInspect(ctx, loopRef)
	if err != nil {
		return fmt.Errorf("inspect %s after Docker's pull: %w", loopRef, err)
	}
	if got.ID != imageID {
		return fmt.Errorf("the pull from the loopback registry gave %s, not %s", got.ID, imageID)
	}
	if err := p.docker.ImageTag(ctx, imageID, ref); err != nil {
		return fmt.Errorf("tag %s as %s: %w", imageID, ref, err)
	}
	if _, err := p.docker.ImageRemove(ctx, loopRef, image.RemoveOptions{PruneChildren: false}); err != nil {
		return fmt.Errorf("untag %s: %w", loopRef, err)
	}
	got, err = p.docker.ImageInspect(ctx, ref)
	if err != nil {
		return fmt.Errorf("inspect %s after the pull: %w", ref, err)
	}
	if got.ID != imageID {
		return fmt.Errorf("after the pull %s is %s, not %s", ref, got.ID, imageID)
	}
	for _, n := range append(append([]string(nil), got.RepoTags...), got.RepoDigests...) {
		if strings.Contains(n, "/"+loopRepoPrefix) {
			return fmt.Errorf("after the pull %s is still named %s", ref, n)
		}
	}
	return nil
}

// dropLoopRef removes the loopback name if Docker's pull left it (a fast
// pull that failed after Docker's pull); a name already gone is fine. It
// runs as the pull ends, so it is not cancelled with it.
func (p *Puller) dropLoopRef(ctx context.Context, loopRef string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	if _, err := p.docker.ImageRemove(ctx, loopRef, image.RemoveOptions{PruneChildren: false}); err != nil && !cerrdefs.IsNotFound(err) {
		p.log.Warn("remove the loopback registry's name of an image", "ref", loopRef, "err", err)
	}
}

// sweepLoopRefs removes the loopback names a pull left when its shim died
// mid-pull: every tag of a loopback registry's repository whose registry
// no longer answers for it. A live one (another pull of this shim's, or
// of another shim on this Docker) serves its own manifest, and is left.
// An image known by such a name alone goes with it: no task was handed
// it.
func (p *Puller) sweepLoopRefs(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	list, err := p.docker.ImageList(ctx, image.ListOptions{Filters: filters.NewArgs(filters.Arg("reference", "*/"+loopRepoPrefix+"*"))})
	if err != nil {
		p.log.Debug("list loopback registry names", "err", err)
		return
	}
	for _, img := range list {
		for _, ref := range img.RepoTags {
			host, repo, tag, ok := splitLoopRef(ref)
			if !ok || liveLoopRef(ctx, host, repo, tag) {
				continue
			}
			if _, err := p.docker.ImageRemove(ctx, ref, image.RemoveOptions{PruneChildren: false}); err != nil && !cerrdefs.IsNotFound(err) {
				p.log.Warn("remove a loopback registry name a stopped pull left", "ref", ref, "err", err)
				continue
			}
			p.log.Info("removed a loopback registry name a stopped pull left", "ref", ref)
		}
	}
}

// splitLoopRef reads 127.0.0.1:<port>/tandem-fastpull/<32 hex>:<tag>.
func splitLoopRef(ref string) (host, repo, tag string, ok bool) {
	host, rest, ok := strings.Cut(ref, "/")
	if !ok {
		return "", "", "", false
	}
	h, port, err := net.SplitHostPort(host)
	if err != nil || h != "127.0.0.1" || port == "" {
		return "", "", "", false
	}
	repo, tag, ok = strings.Cut(rest, ":")
	name, isLoop := strings.CutPrefix(repo, loopRepoPrefix)
	if !ok || !isLoop || len(name) != 32 || !isHex(name) || tag == "" || strings.Contains(tag, "/") {
		return "", "", "", false
	}
	return host, repo, tag, true
}

// liveLoopRef says whether a loopback registry at host still serves
// repo:tag.
func liveLoopRef(ctx context.Context, host, repo, tag string) bool {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodHead, "http://"+host+"/v2/"+repo+"/manifests/"+tag, nil)
	if err != nil {
		return false
	}
	c := &http.Client{Transport: &http.Transport{Proxy: nil, DisableKeepAlives: true}}
	resp, err := c.Do(req)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}
