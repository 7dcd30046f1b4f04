package component

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
)

// scripts stands in for real binaries in these tests.
func scripts(string) error { return nil }

func script(version string) string {
	return "#!/bin/sh\necho dstack-runner version " + version + "\n"
}

func TestProbeAndInstall(t *testing.T) {
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		switch r.URL.Path {
		case "/good":
			_, _ = w.Write([]byte(script("0.21.2+tandem.9")))
		case "/bad-output":
			_, _ = w.Write([]byte("#!/bin/sh\necho runner 1.0\n"))
		default:
			http.Error(w, "nope", http.StatusNotFound)
		}
	}))
	defer srv.Close()
	now := time.Unix(0, 0)
	m := &Manager{Name: api.ComponentRunner, Path: filepath.Join(t.TempDir(), "bin", "dstack-runner"), Now: func() time.Time { return now }, CheckFile: scripts}
	ctx := context.Background()

	if got := m.Info(ctx); got.Status != api.ComponentNotInstalled || got.Version != "" {
		t.Fatalf("missing binary: %+v", got)
	}
	if err := m.EnsureInstalled(ctx, srv.URL+"/good"); err != nil {
		t.Fatal(err)
	}
	if got := m.Info(ctx); got.Status != api.ComponentInstalled || got.Version != "0.21.2+tandem.9" {
		t.Fatalf("installed: %+v", got)
	}
	if err := m.EnsureInstalled(ctx, srv.URL+"/missing"); err != nil || hits.Load() != 1 {
		t.Fatalf("existing binary must not be downloaded again: %v hits=%d", err, hits.Load())
	}

	// A failing URL leaves the old binary in place and backs off.
	done := make(chan error, 1)
	if err := m.StartInstall(ctx, srv.URL+"/missing", func(err error) { done <- err }); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err == nil {
		t.Fatal("404 must fail the install")
	}
	if got := m.Info(ctx); got.Version != "0.21.2+tandem.9" {
		t.Fatalf("failed install must keep the old binary: %+v", got)
	}
	if err := m.StartInstall(ctx, srv.URL+"/missing", nil); !errors.Is(err, ErrBackoff) {
		t.Fatalf("second attempt within backoff: %v", err)
	}
	now = now.Add(31 * time.Second)
	if err := m.StartInstall(ctx, srv.URL+"/missing", func(err error) { done <- err }); err != nil {
		t.Fatalf("after backoff: %v", err)
	}
	<-done
	now = now.Add(31 * time.Second)
	if err := m.StartInstall(ctx, srv.URL+"/missing", nil); !errors.Is(err, ErrBackoff) {
		t.Fatalf("backoff must double after the second failure: %v", err)
	}
	// Another URL is not held back by the failing one.
	if err := m.StartInstall(ctx, srv.URL+"/bad-output", func(err error) { done <- err }); err != nil {
		t.Fatal(err)
	}
	<-done
	// Malformed --version output: refused before it replaced anything.
	if got := m.Info(ctx); got.Status != api.ComponentInstalled || got.Version != "0.21.2+tandem.9" || !strings.Contains(got.InstallError, "printed") {
		t.Fatalf("malformed --version output: %+v", got)
	}
	if entries, _ := os.ReadDir(filepath.Dir(m.Path)); len(entries) != 1 {
		t.Fatalf("temp files left behind: %v", entries)
	}
}

func TestInstallingIsExclusive(t *testing.T) {
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-release
		_, _ = w.Write([]byte(script("1")))
	}))
	defer srv.Close()
	defer close(release)
	m := &Manager{Name: api.ComponentRunner, Path: filepath.Join(t.TempDir(), "r"), CheckFile: scripts}
	if err := m.StartInstall(context.Background(), srv.URL, nil); err != nil {
		t.Fatal(err)
	}
	if got := m.Info(context.Background()); got.Status != api.ComponentInstalling {
		t.Fatalf("status while downloading: %+v", got)
	}
	if err := m.StartInstall(context.Background(), srv.URL, nil); !errors.Is(err, ErrInstalling) {
		t.Fatalf("concurrent install: %v", err)
	}
}

// The probe runs the binary once per file version, and again after any change.
// countingScripts writes scripts into dir that answer `--version` as name
// and count their runs: write(path, version) renames a new one in (a new
// inode), runs() is how many ran so far.
func countingScripts(t *testing.T, dir string, name api.ComponentName) (write func(path, version string), runs func() int) {
	count := filepath.Join(dir, "runs")
	write = func(path, version string) {
		s := "#!/bin/sh\necho x >> " + count + "\necho " + string(name) + " version " + version + "\n"
		if err := os.WriteFile(path+".new", []byte(s), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(path+".new", path); err != nil {
			t.Fatal(err)
		}
	}
	runs = func() int {
		b, _ := os.ReadFile(count)
		return strings.Count(string(b), "x")
	}
	return write, runs
}

func TestProbeRunsOncePerFile(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "dstack-runner")
	writeAt, runs := countingScripts(t, dir, api.ComponentRunner)
	write := func(version string) { writeAt(bin, version) }
	m := &Manager{Name: api.ComponentRunner, Path: bin}
	write("1")
	for i := 0; i < 3; i++ {
		if got := m.Info(context.Background()); got.Version != "1" {
			t.Fatalf("probe: %+v", got)
		}
	}
	if runs() != 1 {
		t.Fatalf("an unchanged binary was run %d times", runs())
	}
	write("2") // same size, new inode: must be probed again
	if got := m.Info(context.Background()); got.Version != "2" || runs() != 2 {
		t.Fatalf("after replace: %+v runs=%d", got, runs())
	}
	_ = os.Remove(bin)
	if got := m.Info(context.Background()); got.Status != api.ComponentNotInstalled {
		t.Fatalf("removed: %+v", got)
	}
}

// TestInstallVerifiesBeforeReplacing: with the default check, a script or a
// binary that is not the component never replaces the installed one, and
// the reason is reported.
func TestInstallVerifiesBeforeReplacing(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	selfBytes, _ := os.ReadFile(self)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/script":
			_, _ = w.Write([]byte(script("9.9.9")))
		case "/other-elf": // an ELF that is not dstack-runner (this test binary)
			_, _ = w.Write(selfBytes)
		}
	}))
	defer srv.Close()
	path := filepath.Join(t.TempDir(), "dstack-runner")
	if err := os.WriteFile(path, []byte(script("0.21.3")), 0o755); err != nil {
		t.Fatal(err)
	}
	m := &Manager{Name: api.ComponentRunner, Path: path}
	for _, tc := range []struct{ url, want string }{
		{"/script", "not an ELF executable"},
		{"/other-elf", "--version`"},
	} {
		done := make(chan error, 1)
		m.mu.Lock()
		m.failedURL = ""
		m.mu.Unlock()
		if err := m.StartInstall(context.Background(), srv.URL+tc.url, func(err error) { done <- err }); err != nil {
			t.Fatal(err)
		}
		err := <-done
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "the installed binary stays") {
			t.Fatalf("%s: %v", tc.url, err)
		}
		info := m.Info(context.Background())
		if info.Version != "0.21.3" || !strings.Contains(info.InstallError, tc.want) {
			t.Fatalf("%s: %+v", tc.url, info)
		}
		if b, _ := os.ReadFile(path); string(b) != script("0.21.3") {
			t.Fatalf("%s replaced the installed binary", tc.url)
		}
		entries, _ := os.ReadDir(filepath.Dir(path))
		if len(entries) != 1 {
			t.Fatalf("leftovers: %v", entries)
		}
	}
}

// TestRunningSkipsTheProbeOfItsOwnFile: a path that is the running
// executable's file (a hard link stands in for /proc/self/exe) is known
// without running it; another file at the path, or the path replaced
// afterwards, is probed as before.
func TestRunningSkipsTheProbeOfItsOwnFile(t *testing.T) {
	dir := t.TempDir()
	bin, self := filepath.Join(dir, "dstack-shim"), filepath.Join(dir, "self")
	write, runs := countingScripts(t, dir, api.ComponentShim)
	m := &Manager{Name: api.ComponentShim, Path: bin}

	// Another file at the path: nothing recorded, the probe runs it.
	write(bin, "1")
	write(self, "9")
	if m.Running(self, "9") {
		t.Fatal("Running recorded a file that is not the running one")
	}
	if got := m.Info(context.Background()); got.Version != "1" || runs() != 1 {
		t.Fatalf("probe of another file: %+v runs=%d", got, runs())
	}

	// The running file itself: its version without a fork.
	_ = os.Remove(self)
	if err := os.Link(bin, self); err != nil {
		t.Fatal(err)
	}
	m = &Manager{Name: api.ComponentShim, Path: bin}
	if !m.Running(self, "7") {
		t.Fatal("Running did not recognise the running file")
	}
	if got := m.Info(context.Background()); got.Status != api.ComponentInstalled || got.Version != "7" || runs() != 1 {
		t.Fatalf("own file: %+v runs=%d (want version 7 and no run)", got, runs())
	}

	// Replaced since (a self-update): probed again.
	write(bin, "2")
	if got := m.Info(context.Background()); got.Version != "2" || runs() != 2 {
		t.Fatalf("after replace: %+v runs=%d", got, runs())
	}
}

// TestVersionCacheSpansRestarts: a probe's result is kept in VersionCache,
// so a new Manager (a restarted shim) knows an unchanged binary without
// running it; a binary replaced, or edited in place with its size and
// mtime put back (ctime still moves), is run again, and a cache that is
// garbage, too big or about another path is ignored.
func TestVersionCacheSpansRestarts(t *testing.T) {
	dir := t.TempDir()
	bin, cache := filepath.Join(dir, "dstack-runner"), filepath.Join(dir, "runner-version.json")
	write, runs := countingScripts(t, dir, api.ComponentRunner)
	restart := func() *Manager { return &Manager{Name: api.ComponentRunner, Path: bin, VersionCache: cache} }
	info := func(m *Manager) api.ComponentInfo { return m.Info(context.Background()) }

	write(bin, "1")
	if got := info(restart()); got.Version != "1" || runs() != 1 {
		t.Fatalf("first probe: %+v runs=%d", got, runs())
	}
	if got := info(restart()); got.Status != api.ComponentInstalled || got.Version != "1" || runs() != 1 {
		t.Fatalf("after a restart: %+v runs=%d (want version 1 from the cache, no run)", got, runs())
	}

	write(bin, "2") // new inode
	if got := info(restart()); got.Version != "2" || runs() != 2 {
		t.Fatalf("replaced: %+v runs=%d", got, runs())
	}

	// Edited in place, same size, mtime put back: ctime tells.
	fi, err := os.Stat(bin)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(bin)
	time.Sleep(10 * time.Millisecond) // a ctime tick apart
	if err := os.WriteFile(bin, bytes.Replace(b, []byte("version 2"), []byte("version 3"), 1), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chtimes(bin, fi.ModTime(), fi.ModTime()); err != nil {
		t.Fatal(err)
	}
	if got := info(restart()); got.Version != "3" || runs() != 3 {
		t.Fatalf("edited in place: %+v runs=%d", got, runs())
	}

	// Caches that name the right file but must not be trusted: each
	// claims version "cached"; the probe says 3.
	var good versionCache
	if b, err := os.ReadFile(cache); err != nil || json.Unmarshal(b, &good) != nil || good.Version != "3" {
		t.Fatalf("cache after the probe: %s %v", b, err)
	}
	file, _ := json.Marshal(good.File)
	for name, content := range map[string]string{
		"trusted (control)": `{"path":"` + bin + `","file":` + string(file) + `,"version":"cached"}`,
		"garbage":           `{"path":"` + bin + `","file":` + string(file) + `,"version":"cached"`,
		"another path":      `{"path":"/elsewhere","file":` + string(file) + `,"version":"cached"}`,
		"bad version":       `{"path":"` + bin + `","file":` + string(file) + `,"version":"cac hed"}`,
		"too big":           `{"pad":"` + strings.Repeat("x", maxVersionCache) + `","path":"` + bin + `","file":` + string(file) + `,"version":"cached"}`,
	} {
		if err := os.WriteFile(cache, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		before := runs()
		got := info(restart())
		if name == "trusted (control)" {
			if got.Version != "cached" || runs() != before {
				t.Errorf("%s: %+v runs=%d (want the cached version, no probe)", name, got, runs()-before)
			}
			continue
		}
		if got.Version != "3" || runs() != before+1 {
			t.Errorf("%s cache: %+v runs=%d (want a probe)", name, got, runs()-before)
		}
	}
	write(bin, "3")
	_ = info(restart())
	before := runs()
	if got := info(restart()); got.Version != "3" || runs() != before {
		t.Fatalf("the rewritten cache: %+v runs=%d (want none)", got, runs()-before)
	}
}
