// Package imagegc frees Docker's disk on a long-lived host, as kubelet's
// image garbage collection does (issue 65, item 4; dstack #2020: a disk
// that filled mid-pull). When the filesystem of Docker's data root is
// HighPercent used (85 by default), it removes images, least recently
// used first, until it is LowPercent used (80) or no image is left that
// may go. Only an image a registry holds (Docker has its digest) or one
// the shim loaded itself (Ledger) may go: one built or loaded on the host
// may exist nowhere else. Never removed either: an image a container uses (running or stopped),
// one a task of the shim is about to use (pulling, or pulled and not yet
// created), one first seen less than MinAge ago (a pull that has not
// become a container yet), one the operator keeps (pre-pulled into the
// machine image). Removal is never forced: an image Docker refuses to
// remove (a container made meanwhile) stays, and the pass goes on.
package imagegc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"
)

// Policy says when to collect and what to keep.
type Policy struct {
	HighPercent int           // collect when the disk is at least this full
	LowPercent  int           // free down to this
	MinAge      time.Duration // an image seen for less than this stays
	// Keep: references (name:tag, name alone meaning :latest) or image
	// IDs never removed.
	Keep []string
}

// DefaultPolicy is kubelet's: 85%, 80%, two minutes.
func DefaultPolicy() Policy {
	return Policy{HighPercent: 85, LowPercent: 80, MinAge: 2 * time.Minute}
}

// Validate refuses thresholds that cannot work.
func (p Policy) Validate() error {
	if p.HighPercent < 1 || p.HighPercent > 100 {
		return fmt.Errorf("image GC high threshold %d%%: want 1-100", p.HighPercent)
	}
	if p.LowPercent < 0 || p.LowPercent >= p.HighPercent {
		return fmt.Errorf("image GC low threshold %d%%: want 0 to below the high threshold (%d%%)", p.LowPercent, p.HighPercent)
	}
	if p.MinAge < 0 {
		return errors.New("image GC minimum age is negative")
	}
	return nil
}

// Usage is a filesystem's size and what is free on it, in bytes.
type Usage struct {
	Total, Free uint64
}

// Percent is how full it is.
func (u Usage) Percent() float64 {
	if u.Total == 0 {
		return 0
	}
	return float64(u.Total-min(u.Free, u.Total)) * 100 / float64(u.Total)
}

// Disk reads a filesystem's usage (statfs on the host; a fake in tests).
type Disk interface {
	Usage(path string) (Usage, error)
}

// Image is one image of the engine.
type Image struct {
	ID       string // sha256:...
	RepoTags []string
	Size     int64
	// Pulled: a registry holds it (Docker knows a digest of it: it came
	// by a pull), so it can be pulled again.
	Pulled bool
}

// Engine is what the collector needs of Docker.
type Engine interface {
	Images(ctx context.Context) ([]Image, error)
	// ContainerImageIDs: the image ID of every container, running or not.
	ContainerImageIDs(ctx context.Context) ([]string, error)
	// RemoveImage removes an image unforced (its untagged parents too).
	RemoveImage(ctx context.Context, img Image) error
}

// Collector runs the passes; its records of when each image was first
// seen and last used live as long as it does (kubelet's do too: after a
// restart every image counts as seen just now, and MinAge holds it).
type Collector struct {
	Policy Policy
	Disk   Disk
	Engine Engine
	Path   string // Docker's data root
	// Tasks gives the image references the shim's tasks want (any state
	// before their container exists); they stay.
	Tasks func() []string
	// Ours gives the IDs of the images the shim loaded into Docker itself
	// (Ledger.IDs). Only those and pulled ones may go: an image built or
	// loaded on the host by anyone else may exist nowhere else.
	Ours func() (map[string]bool, error)
	Now  func() time.Time
	Log  *slog.Logger

	mu        sync.Mutex
	firstSeen map[string]time.Time
	lastUsed  map[string]time.Time
}

// Report is what one pass did.
type Report struct {
	Before, After float64  // percent used
	Removed       []string // image IDs
	Freed         int64    // their sizes (shared layers count in each)
}

// Collect is one pass: record which images exist and are used, and
// remove what may go while the disk is above the low threshold, when it
// started at or above the high one.
func (c *Collector) Collect(ctx context.Context) (Report, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := time.Now()
	if c.Now != nil {
		now = c.Now()
	}
	images, err := c.Engine.Images(ctx)
	if err != nil {
		return Report{}, fmt.Errorf("list images: %w", err)
	}
	used, err := c.Engine.ContainerImageIDs(ctx)
	if err != nil {
		return Report{}, fmt.Errorf("list containers: %w", err)
	}
	c.record(images, used, now)
	u, err := c.Disk.Usage(c.Path)
	if err != nil {
		return Report{}, fmt.Errorf("disk usage of %s: %w", c.Path, err)
	}
	rep := Report{Before: u.Percent(), After: u.Percent()}
	if rep.Before < float64(c.Policy.HighPercent) {
		return rep, nil
	}
	var wanted []string
	if c.Tasks != nil {
		wanted = c.Tasks()
	}
	ours := map[string]bool{}
	if c.Ours != nil {
		if ours, err = c.Ours(); err != nil {
			return rep, fmt.Errorf("the shim's own images: %w", err)
		}
	}
	var candidates []Image
	for _, img := range images {
		if !img.Pulled && !ours[img.ID] {
			continue // nobody could fetch it again
		}
		if slices.Contains(used, img.ID) || matches(img, c.Policy.Keep) || matches(img, wanted) || now.Sub(c.firstSeen[img.ID]) < c.Policy.MinAge {
			continue
		}
		candidates = append(candidates, img)
	}
	// Least recently used first; never used counts as used when first
	// seen; ties by size, biggest first (fewer removals).
	slices.SortStableFunc(candidates, func(a, b Image) int {
		if d := c.lastUse(a.ID).Compare(c.lastUse(b.ID)); d != 0 {
			return d
		}
		return int(min(max(b.Size-a.Size, -1), 1))
	})
	c.Log.Info("image GC: disk above its high threshold", "path", c.Path, "used_percent", round1(rep.Before),
		"high_percent", c.Policy.HighPercent, "low_percent", c.Policy.LowPercent, "candidates", len(candidates))
	for _, img := range candidates {
		if err := ctx.Err(); err != nil {
			return rep, err
		}
		if err := c.Engine.RemoveImage(ctx, img); err != nil {
			// A container made since the listing, or an image another
			// holds: it stays, the pass goes on.
			c.Log.Warn("image GC: image not removed", "image", img.ID, "tags", img.RepoTags, "err", err)
			continue
		}
		delete(c.firstSeen, img.ID)
		delete(c.lastUsed, img.ID)
		rep.Removed = append(rep.Removed, img.ID)
		rep.Freed += img.Size
		c.Log.Info("image GC: removed", "image", img.ID, "tags", img.RepoTags, "size", img.Size)
		if u, err := c.Disk.Usage(c.Path); err == nil {
			rep.After = u.Percent()
			if rep.After <= float64(c.Policy.LowPercent) {
				break
			}
		}
	}
	if rep.After > float64(c.Policy.LowPercent) {
		c.Log.Warn("image GC: disk still above its low threshold: what is left is in use or kept", "path", c.Path,
			"used_percent", round1(rep.After), "low_percent", c.Policy.LowPercent, "removed", len(rep.Removed))
	}
	return rep, nil
}

// Run collects at every tick until ctx ends; a failed pass is logged.
func (c *Collector) Run(ctx context.Context, ticks <-chan time.Time) {
	for {
		if _, err := c.Collect(ctx); err != nil && ctx.Err() == nil {
			c.Log.Warn("image GC pass failed", "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-ticks:
		}
	}
}

func (c *Collector) record(images []Image, used []string, now time.Time) {
	if c.firstSeen == nil {
		c.firstSeen, c.lastUsed = map[string]time.Time{}, map[string]time.Time{}
	}
	present := make(map[string]bool, len(images))
	for _, img := range images {
		present[img.ID] = true
		if _, ok := c.firstSeen[img.ID]; !ok {
			c.firstSeen[img.ID] = now
		}
	}
	for _, id := range used {
		if present[id] {
			c.lastUsed[id] = now
		}
	}
	for id := range c.firstSeen {
		if !present[id] {
			delete(c.firstSeen, id)
			delete(c.lastUsed, id)
		}
	}
}

func (c *Collector) lastUse(id string) time.Time {
	if t, ok := c.lastUsed[id]; ok {
		return t
	}
	return c.firstSeen[id]
}

// matches says whether img is named by any of refs: its ID (or an ID
// prefix of 12 or more hex digits), or one of its tags, a name without a
// tag meaning :latest and Docker Hub's prefixes ignored.
func matches(img Image, refs []string) bool {
	for _, r := range refs {
		r = strings.TrimSpace(r)
		if r == "" {
			continue
		}
		if hex := strings.TrimPrefix(r, "sha256:"); len(hex) >= 12 && strings.HasPrefix(strings.TrimPrefix(img.ID, "sha256:"), hex) {
			return true
		}
		n := normalize(r)
		for _, t := range img.RepoTags {
			if normalize(t) == n {
				return true
			}
		}
	}
	return false
}

// normalize is a reference as Docker lists it: no docker.io/library/
// prefix, :latest when it names no tag or digest.
func normalize(ref string) string {
	ref = strings.TrimPrefix(ref, "docker.io/")
	ref = strings.TrimPrefix(ref, "index.docker.io/")
	ref = strings.TrimPrefix(ref, "library/")
	if strings.Contains(ref, "@") {
		return ref
	}
	slash := strings.LastIndex(ref, "/")
	if !strings.Contains(ref[slash+1:], ":") {
		ref += ":latest"
	}
	return ref
}

func round1(f float64) float64 { return float64(int(f*10+0.5)) / 10 }
