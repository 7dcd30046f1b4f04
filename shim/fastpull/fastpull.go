// Package fastpull owns the shim's fast image pull: the registry's blobs
// fetched over several ranged connections and checked against their
// digests, and served as they arrive to Docker's own pull by a read-only
// registry on loopback that lives for that one pull, so Docker unpacks a
// layer while later ones still arrive and the image is the one its pull
// from upstream gives (its ID is the config's digest, RepoTags the name
// asked). It sits behind the task engine's Pull and speaks Docker's JSON
// progress stream, so the pull tracker and its stall watchdog read it as
// they read Docker's; whenever it cannot do a pull as Docker would (a
// proxy, a mirror, a digest reference, a manifest or auth it does not
// read, a bad blob) it hands the pull to Docker's own, with one log line.
package fastpull

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/tandem-run/tandem/shim/task"
)

// Config is the fast pull's configuration.
type Config struct {
	// Enabled turns the fast path on (--image-fast-pull); off, every pull
	// is Docker's. On the cold bench (1.6 GB, 7 layers, 100 Mbit/s per
	// connection, 1 Gbit/s in all; a 2-core VM another job kept busy,
	// BenchmarkColdStart with TANDEM_BENCH_COLD_AUTH=basic, one round
	// each) the shim's submit -> running took 0.61x, 0.72x and, with the
	// layer-ordered gate, 0.66x docker pull's time beside it (68, 103 and
	// 104 s), every byte down at 15-16 s: the rest is Docker unpacking one
	// layer after another, 1.26x, 1.30x and 1.21x its own floor there
	// (docker load of the plain layers). The ImageLoad hand-off it
	// replaced took 0.69x (74 s; 1.38x that floor), where Docker's load
	// began only once the whole archive was there.
	Enabled bool
	// TempDir holds a pull's blobs while it runs (the shim's home
	// image-pull); each pull's own dir is removed when it ends.
	TempDir string
	// Loaded, when set, is told the ID of every image this path put into
	// Docker (the image GC's ledger: such an image has no RepoDigests,
	// its loopback name being gone, yet the shim may remove it).
	Loaded func(imageID string) error `json:"-"`
	// Admit, when set, decides each connection to a pull's loopback
	// registry (server.Access.AdmitRegistryConn: root-equivalent accounts
	// on the host, not a container, Docker's daemon among them); nil
	// admits every one, and the registry's random 128-bit name, served
	// only during its pull, is all that keeps another local account from
	// reading the image.
	Admit func(net.Conn) (bool, string) `json:"-"`
	// Conns bounds one pull's open connections, all its blobs together.
	Conns int
	// ChunkSize is one ranged request's size.
	ChunkSize int64
	// IdleTimeout ends (and retries) a request that moves no byte.
	IdleTimeout time.Duration
	// CertsDir is Docker's per-registry TLS dir (/etc/docker/certs.d).
	CertsDir string
	// Loopback takes the fast path for registries on this machine too.
	// Off, they are Docker's: with no link to beat, the ImageLoad hand-off
	// was slower there (1.68x Docker's pull,
	// BenchmarkFastPullVsDockerPull/layers).
	Loopback bool
}

// Defaults are the fast pull's defaults (the flags show them).
func Defaults() Config {
	return Config{
		Enabled:     true,
		Conns:       16,
		ChunkSize:   16 << 20,
		IdleTimeout: 30 * time.Second,
		CertsDir:    "/etc/docker/certs.d",
	}
}

// WithDefaults fills c's zero sizes from Defaults.
func (c Config) WithDefaults() Config {
	d := Defaults()
	c.Conns = cmp.Or(c.Conns, d.Conns)
	c.ChunkSize = cmp.Or(c.ChunkSize, d.ChunkSize)
	c.IdleTimeout = cmp.Or(c.IdleTimeout, d.IdleTimeout)
	c.CertsDir = cmp.Or(c.CertsDir, d.CertsDir)
	return c
}

// PullFunc is Docker's own pull: the fallback.
type PullFunc func(ctx context.Context, ref string, auth task.RegistryAuth) (io.ReadCloser, error)

// Puller runs fast pulls; one image's concurrent pulls are one.
type Puller struct {
	cfg    Config
	docker Docker
	log    *slog.Logger
	now    func() time.Time

	mu      sync.Mutex // guards flights
	flights map[string]*flight
}

// flight is one pull that every task asking for that image reads.
type flight struct {
	h      *hub
	refs   int
	cancel context.CancelCauseFunc
}

// New returns a Puller on docker. It removes what earlier runs left in
// cfg.TempDir (a shim killed mid-pull).
func New(cfg Config, docker Docker, log *slog.Logger) *Puller {
	cfg = cfg.WithDefaults()
	p := &Puller{cfg: cfg, docker: docker, log: log, now: time.Now, flights: map[string]*flight{}}
	if cfg.TempDir != "" {
		if old, err := filepath.Glob(filepath.Join(cfg.TempDir, "pull-*")); err == nil {
			for _, d := range old {
				if err := os.RemoveAll(d); err != nil {
					log.Warn("remove a pull's leftover temporary dir", "dir", d, "err", err)
				}
			}
		}
	}
	return p
}

// Pull is the engine's Pull: the fast path's progress stream, which turns
// into Docker's pull's when the fast path gives up.
func (p *Puller) Pull(ctx context.Context, ref string, auth task.RegistryAuth, fallback PullFunc) (io.ReadCloser, error) {
	if !p.cfg.Enabled || p.cfg.TempDir == "" {
		return fallback(ctx, ref, auth)
	}
	key := flightKey(ref, auth)
	p.mu.Lock()
	fl := p.flights[key]
	if fl == nil {
		fctx, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
		fl = &flight{h: newHub(), cancel: cancel}
		p.flights[key] = fl
		go p.run(fctx, key, fl, ref, auth, fallback)
	}
	fl.refs++
	p.mu.Unlock()
	r := &reader{ctx: ctx, h: fl.h}
	r.leave = func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		if fl.refs--; fl.refs == 0 {
			fl.cancel(errors.New("every task waiting on this pull is gone"))
		}
	}
	return r, nil
}

func flightKey(ref string, auth task.RegistryAuth) string {
	h := sha256.Sum256([]byte(ref + "\x00" + auth.Username + "\x00" + auth.Password))
	return hex.EncodeToString(h[:])
}

func (p *Puller) run(ctx context.Context, key string, fl *flight, ref string, auth task.RegistryAuth, fallback PullFunc) {
	defer func() {
		p.mu.Lock()
		if p.flights[key] == fl {
			delete(p.flights, key)
		}
		p.mu.Unlock()
		fl.cancel(nil)
	}()
	began := p.now()
	ph := &phases{start: time.Now()}
	err := p.fast(ctx, fl.h, ref, auth, ph)
	if err == nil {
		p.log.Info("image pulled by the fast path", append([]any{"image", ref, "took", p.now().Sub(began).Round(time.Millisecond)}, ph.logArgs()...)...)
		fl.h.close(nil)
		return
	}
	if ctx.Err() != nil {
		fl.h.close(context.Cause(ctx))
		return
	}
	if errors.Is(err, errUnsupported) {
		p.log.Info("fast image pull not taken, Docker pulls instead", "image", ref, "reason", err)
	} else {
		p.log.Warn("fast image pull gave up, Docker pulls instead", "image", ref, "err", err)
	}
	rc, err := fallback(ctx, ref, auth)
	if err != nil {
		fl.h.close(err)
		return
	}
	_, err = io.Copy(&hubWriter{h: fl.h}, rc)
	rc.Close()
	fl.h.close(err)
}

// errUnsupported is a pull the fast path leaves to Docker by design.
var errUnsupported = errors.New("not for the fast path")

func unsupported(format string, a ...any) error {
	return fmt.Errorf("%w: %s", errUnsupported, fmt.Sprintf(format, a...))
}
