package component

import (
	"context"
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
	m := &Manager{Name: api.ComponentRunner, Path: filepath.Join(t.TempDir(), "bin", "dstack-runner"), Now: func() time.Time { return now }}
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
	if got := m.Info(ctx); got.Status != api.ComponentError {
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
	m := &Manager{Name: api.ComponentRunner, Path: filepath.Join(t.TempDir(), "r")}
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
func TestProbeRunsOncePerFile(t *testing.T) {
	dir := t.TempDir()
	count := filepath.Join(dir, "runs")
	bin := filepath.Join(dir, "dstack-runner")
	write := func(version string) {
		s := "#!/bin/sh\necho x >> " + count + "\necho dstack-runner version " + version + "\n"
		if err := os.WriteFile(bin+".new", []byte(s), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(bin+".new", bin); err != nil {
			t.Fatal(err)
		}
	}
	runs := func() int {
		b, _ := os.ReadFile(count)
		return strings.Count(string(b), "x")
	}
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
