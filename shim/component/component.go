// Package component manages the binaries the dstack server keeps up to date
// through the shim: dstack-runner and dstack-shim itself. It probes their
// version and installs new ones atomically, with a backoff on repeated
// failures so a bad URL is not downloaded on every instance check.
package component

import (
	"context"
	"debug/elf"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/atomicfile"
)

// Errors of Install.
var (
	ErrInstalling = errors.New("already installing")
	ErrBackoff    = errors.New("install backoff")
)

// Manager is one component.
type Manager struct {
	Name api.ComponentName
	Path string
	// DownloadTimeout bounds one download (default 10 minutes).
	DownloadTimeout time.Duration
	// BackoffBase is the wait after the first failure, doubled per failure
	// and capped at BackoffMax.
	BackoffBase, BackoffMax time.Duration
	HTTP                    *http.Client
	Log                     *slog.Logger
	Now                     func() time.Time
	// Observe hears each install's result (nil: nobody listens).
	Observe func(component string, err error)
	// CheckFile vets a download before its --version is run; nil means an
	// ELF executable for this machine (never a script).
	CheckFile func(path string) error
	// VersionCache keeps the last successful probe (the file's identity and
	// its version) across restarts, so a restarted shim does not run an
	// unchanged binary again; "" keeps none. It lives in the shim's home:
	// whoever can write there is root already.
	VersionCache string

	mu         sync.Mutex // guards the fields below
	installing bool
	failedURL  string
	failures   int
	retryAt    time.Time
	known      fileID // the file whose probe succeeded
	version    string // its version
	lastErr    string // why the last install failed; "" after a success
	cacheRead  bool   // VersionCache was looked at
}

// MaxDownload bounds a component download (our binaries are ~15 MB).
const MaxDownload = 512 << 20

// fileID identifies a file's content well enough to reuse a probe: an
// install renames a new file in (new inode), an edit changes size, mtime
// and always ctime (which no one can set back, unlike mtime).
type fileID struct {
	Dev   uint64 `json:"dev"`
	Ino   uint64 `json:"ino"`
	Size  int64  `json:"size"`
	Mtime int64  `json:"mtime_ns"`
	Ctime int64  `json:"ctime_ns"`
}

func idOf(fi os.FileInfo) fileID {
	id := fileID{Size: fi.Size(), Mtime: fi.ModTime().UnixNano()}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		id.Dev, id.Ino = uint64(st.Dev), st.Ino
		id.Ctime = st.Ctim.Nano()
	}
	return id
}

// versionCache is VersionCache's content.
type versionCache struct {
	Path    string `json:"path"`
	File    fileID `json:"file"`
	Version string `json:"version"`
}

// maxVersionCache bounds what is read of VersionCache.
const maxVersionCache = 4 << 10

// readCache seeds the known file from VersionCache once, when it names
// Path and a plausible version; anything else in it is ignored (the probe
// runs and rewrites it). Called with mu held.
func (m *Manager) readCache() {
	if m.cacheRead || m.VersionCache == "" {
		return
	}
	m.cacheRead = true
	f, err := os.Open(m.VersionCache)
	if err != nil {
		return
	}
	defer f.Close()
	var c versionCache
	if err := json.NewDecoder(io.LimitReader(f, maxVersionCache)).Decode(&c); err != nil {
		return
	}
	if c.Path != m.Path || !plausibleVersion(c.Version) || m.version != "" {
		return
	}
	m.known, m.version = c.File, c.Version
}

// writeCache records a successful probe in VersionCache (best effort: a
// failure costs a probe at the next start).
func (m *Manager) writeCache(id fileID, version string) {
	if m.VersionCache == "" {
		return
	}
	b, err := json.Marshal(versionCache{Path: m.Path, File: id, Version: version})
	if err == nil {
		err = atomicfile.WriteBytes(m.VersionCache, append(b, '\n'), atomicfile.Options{Perm: 0o600})
	}
	if err != nil && m.Log != nil {
		m.Log.Warn("cannot keep the component's version for the next start", "component", m.Name, "err", err)
	}
}

// plausibleVersion is a version as `--version` prints it: one short word.
func plausibleVersion(v string) bool {
	return v != "" && len(v) <= 64 && !strings.ContainsFunc(v, func(r rune) bool { return r <= ' ' || r > '~' })
}

func (m *Manager) now() time.Time {
	if m.Now != nil {
		return m.Now()
	}
	return time.Now()
}

// Info probes the binary: `<path> --version` must print exactly three words,
// `<name> version <v>`.
func (m *Manager) Info(ctx context.Context) api.ComponentInfo {
	m.mu.Lock()
	installing, lastErr := m.installing, m.lastErr
	m.mu.Unlock()
	info := api.ComponentInfo{Name: m.Name, InstallError: lastErr}
	if installing {
		info.Status = api.ComponentInstalling
		return info
	}
	info.Status, info.Version = m.probe(ctx)
	return info
}

// probe runs `<path> --version`, unless the file is the one already probed
// successfully: the server asks on every instance check, and forking the
// binary each time buys nothing while the file is unchanged. Failures are
// not remembered, so a transient one is retried on the next call.
func (m *Manager) probe(ctx context.Context) (api.ComponentStatus, string) {
	fi, err := os.Stat(m.Path)
	if os.IsNotExist(err) {
		return api.ComponentNotInstalled, ""
	} else if err != nil {
		return api.ComponentError, ""
	}
	id := idOf(fi)
	m.mu.Lock()
	m.readCache()
	if m.version != "" && m.known == id {
		v := m.version
		m.mu.Unlock()
		return api.ComponentInstalled, v
	}
	m.mu.Unlock()
	status, version := m.runVersion(ctx)
	if status == api.ComponentInstalled {
		m.mu.Lock()
		m.known, m.version = id, version
		m.mu.Unlock()
		m.writeCache(id, version)
	}
	return status, version
}

// Running records that the file at Path is the running executable (exe:
// /proc/self/exe, which names the process's file even after it was
// replaced or removed) and that its version is v, so its probe forks
// nothing while the file stays the same: the shim probing itself at start
// cost a process start (34 ms here) before the API served. Nothing is
// recorded, and false returned, when Path is another file: a newer binary
// installed since the process started is still probed.
func (m *Manager) Running(exe, v string) bool {
	fi, err := os.Stat(m.Path)
	if err != nil {
		return false
	}
	self, err := os.Stat(exe)
	if err != nil || !os.SameFile(fi, self) {
		return false
	}
	m.mu.Lock()
	m.known, m.version = idOf(fi), v
	m.mu.Unlock()
	return true
}

func (m *Manager) runVersion(ctx context.Context) (api.ComponentStatus, string) {
	v, err := m.versionOf(ctx, m.Path)
	if err != nil {
		return api.ComponentError, ""
	}
	return api.ComponentInstalled, v
}

// versionOf runs `<path> --version`, which must print exactly
// "<name> version <v>" within 5 s.
func (m *Manager) versionOf(ctx context.Context, path string) (string, error) {
	return m.versionWithin(ctx, path, 5*time.Second)
}

// versionWithin is versionOf with its own time limit.
func (m *Manager) versionWithin(ctx context.Context, path string, limit time.Duration) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	var out []byte
	var err error
	for {
		cmd := exec.CommandContext(ctx, path, "--version")
		cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
		out, err = cmd.Output()
		// ETXTBSY: a file just written can still be open for writing in a
		// child forked meanwhile by another goroutine (between its fork and
		// exec; Go issue 22315). It clears in moments.
		if !errors.Is(err, syscall.ETXTBSY) || ctx.Err() != nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		return "", fmt.Errorf("`%s --version` failed: %w", filepath.Base(m.Path), err)
	}
	f := strings.Fields(string(out))
	if len(f) != 3 || f[0] != string(m.Name) || f[1] != "version" {
		return "", fmt.Errorf("`--version` printed %.80q, not %q", out, string(m.Name)+" version <v>")
	}
	return f[2], nil
}

// StartInstall begins a background install from url (force: always
// download). It fails at once while installing or backing off.
func (m *Manager) StartInstall(ctx context.Context, url string, done func(error)) error {
	if err := m.begin(url); err != nil {
		return err
	}
	go func() {
		err := m.install(ctx, url)
		m.end(url, err)
		if done != nil {
			done(err)
		}
	}()
	return nil
}

// EnsureInstalled downloads url only if the binary is missing (used at start).
func (m *Manager) EnsureInstalled(ctx context.Context, url string) error {
	if _, err := os.Stat(m.Path); err == nil {
		return nil
	}
	if err := m.begin(url); err != nil {
		return err
	}
	err := m.install(ctx, url)
	m.end(url, err)
	return err
}

func (m *Manager) begin(url string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.installing {
		return ErrInstalling
	}
	if url == m.failedURL && m.now().Before(m.retryAt) {
		return fmt.Errorf("%w: %d failed attempts for this url, next after %s", ErrBackoff, m.failures, m.retryAt.Sub(m.now()).Round(time.Second))
	}
	m.installing = true
	return nil
}

func (m *Manager) end(url string, err error) {
	if m.Observe != nil {
		m.Observe(string(m.Name), err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.installing = false
	if err == nil {
		m.failedURL, m.failures, m.lastErr = "", 0, ""
		return
	}
	m.lastErr = err.Error()
	if url != m.failedURL {
		m.failedURL, m.failures = url, 0
	}
	m.failures++
	base, maxWait := m.BackoffBase, m.BackoffMax
	if base == 0 {
		base = 30 * time.Second
	}
	if maxWait == 0 {
		maxWait = 30 * time.Minute
	}
	wait := base << min(m.failures-1, 20)
	m.retryAt = m.now().Add(min(wait, maxWait))
	if m.Log != nil {
		m.Log.Error("component install failed", "component", m.Name, "url", url, "failures", m.failures, "retry_in", min(wait, maxWait), "err", err)
	}
}

// checkExecutable requires an ELF executable for this machine's
// architecture: never a script (a shebang line runs anything).
func checkExecutable(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("not an ELF executable: %w", err)
	}
	defer f.Close()
	want := map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}[runtime.GOARCH]
	if want != 0 && f.Machine != want {
		return fmt.Errorf("built for %s, this host is %s", f.Machine, runtime.GOARCH)
	}
	if f.Type != elf.ET_EXEC && f.Type != elf.ET_DYN {
		return fmt.Errorf("ELF type %s is not an executable", f.Type)
	}
	return nil
}

// install downloads url into a temp file next to Path, fsyncs it, makes it
// executable and renames it over Path.
func (m *Manager) install(ctx context.Context, url string) error {
	timeout := m.DownloadTimeout
	if timeout == 0 {
		timeout = 10 * time.Minute
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return fmt.Errorf("download %s: %w", m.Name, err)
	}
	hc := m.HTTP
	if hc == nil {
		hc = http.DefaultClient
	}
	resp, err := hc.Do(req)
	if err != nil {
		return fmt.Errorf("download %s: %w", m.Name, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("download %s: %s: unexpected status %s", m.Name, url, resp.Status)
	}
	dir := filepath.Dir(m.Path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("install %s: %w", m.Name, err)
	}
	// Verified before it replaces anything: a download that is not this
	// component (an HTML error page, a script, another binary) is refused
	// and the installed binary stays.
	body := &io.LimitedReader{R: resp.Body, N: MaxDownload + 1}
	var got string
	n, err := atomicfile.Write(m.Path, body, atomicfile.Options{Perm: 0o755, UID: -1, RejectEmpty: true,
		Verify: func(tmp string) error {
			if body.N <= 0 {
				return fmt.Errorf("download is larger than %d bytes", MaxDownload)
			}
			check := m.CheckFile
			if check == nil {
				check = checkExecutable
			}
			if err := check(tmp); err != nil {
				return err
			}
			// A fresh binary's first start can be slow on a loaded host;
			// a refusal here costs a backoff, so wait longer than a probe.
			v, err := m.versionWithin(ctx, tmp, 30*time.Second)
			got = v
			return err
		}})
	if err != nil {
		return fmt.Errorf("install %s from %s refused, the installed binary stays: %w", m.Name, url, err)
	}
	if m.Log != nil {
		m.Log.Info("component verified", "component", m.Name, "version", got)
	}
	if m.Log != nil {
		m.Log.Info("component installed", "component", m.Name, "path", m.Path, "bytes", n)
	}
	return nil
}
