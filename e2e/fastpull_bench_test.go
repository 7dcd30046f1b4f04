package e2e

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/e2e/testenv"
	"github.com/tandem-run/tandem/shim/dockerrt"
	"github.com/tandem-run/tandem/shim/fastpull"
	"github.com/tandem-run/tandem/shim/pull"
	"github.com/tandem-run/tandem/shim/task"
)

// BenchmarkFastPullVsDockerPull times the fast path against Docker's pull
// of one image from an uncapped loopback registry, alternating, every
// layer absent before each: "layers" is four layers of real files (Go's
// tree, LLVM's library; ~350 MB unpacked), "onelayer" two LLVM
// libraries in one layer (217 MB). Each op is one pull; the fast one
// reports its ratio to Docker's (docker/op is Docker's seconds).
func BenchmarkFastPullVsDockerPull(b *testing.B) {
	testenv.RequireDocker(b)
	reg := testenv.StartRegistry(b)
	base := testenv.Busybox(b)
	for _, c := range []struct {
		name string
		dirs [][]string
	}{
		{"layers", [][]string{{"/usr/local/go/src"}, {"/usr/local/go/pkg"}, {"/usr/local/go/bin", "/usr/local/go/lib"}, {"/usr/lib/x86_64-linux-gnu/libLLVM-15.so.1"}}},
		{"onelayer", [][]string{{"/usr/lib/x86_64-linux-gnu/libLLVM-14.so.1", "/usr/lib/x86_64-linux-gnu/libLLVM-15.so.1"}}},
	} {
		b.Run(c.name, func(b *testing.B) {
			ref := pushSlow(b, reg, benchImage(b, base, c.dirs), "tandem/bench-"+c.name+":v1")
			rt, err := dockerrt.New()
			if err != nil {
				b.Fatal(err)
			}
			defer rt.Close()
			auth := task.RegistryAuth{Username: reg.Username, Password: reg.Password, ServerAddress: reg.Addr}
			p := fastpull.New(fastpull.Config{Enabled: true, Loopback: true, TempDir: b.TempDir()}, rt.Client(), slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
			var fast, docker time.Duration
			for range b.N {
				docker += timePull(b, ref, func(ctx context.Context) (io.ReadCloser, error) { return rt.Pull(ctx, ref, auth) })
				fast += timePull(b, ref, func(ctx context.Context) (io.ReadCloser, error) {
					return p.Pull(ctx, ref, auth, func(context.Context, string, task.RegistryAuth) (io.ReadCloser, error) {
						return nil, fmt.Errorf("the fast path fell back")
					})
				})
			}
			b.ReportMetric(docker.Seconds()/float64(b.N), "docker-s/op")
			b.ReportMetric(fast.Seconds()/float64(b.N), "fast-s/op")
			b.ReportMetric(fast.Seconds()/docker.Seconds(), "fast/docker")
		})
	}
}

// timePull removes ref, runs one pull to its end and checks the image is there.
func timePull(b *testing.B, ref string, start func(context.Context) (io.ReadCloser, error)) (took time.Duration) {
	b.Helper()
	ctx := context.Background()
	_, _ = testenv.Docker(ctx, "rmi", ref)
	_ = exec.Command("sync").Run()
	t0 := time.Now()
	rc, err := start(ctx)
	if err != nil {
		b.Fatal(err)
	}
	err = pull.NewTracker(time.Now).Feed(rc, nil)
	rc.Close()
	took = time.Since(t0)
	b.Logf("pull of %s: %s", ref, took.Round(10*time.Millisecond))
	if err != nil {
		b.Fatal(err)
	}
	if _, err := testenv.Docker(ctx, "image", "inspect", ref); err != nil {
		b.Fatal(err)
	}
	return took
}

// benchImage builds base plus one layer per entry of dirs (copies of the
// host's files: real binaries and libraries, 2-3x compressible).
func benchImage(b *testing.B, base string, dirs [][]string) string {
	b.Helper()
	ctxDir := b.TempDir()
	df := "FROM " + base + "\n"
	for i, group := range dirs {
		dst := filepath.Join(ctxDir, fmt.Sprint(i))
		if err := os.MkdirAll(dst, 0o755); err != nil {
			b.Fatal(err)
		}
		for _, d := range group {
			if out, err := exec.Command("cp", "-a", d, dst+"/").CombinedOutput(); err != nil {
				b.Fatalf("cp %s: %v %s", d, err, out)
			}
		}
		df += fmt.Sprintf("COPY %d /l%d/\n", i, i)
	}
	if err := os.WriteFile(filepath.Join(ctxDir, "Dockerfile"), []byte(df), 0o644); err != nil {
		b.Fatal(err)
	}
	tag := "tandem-test/bench:" + strings.ToLower(randomID("i"))
	if _, err := testenv.Docker(context.Background(), "build", "-q", "-t", tag, ctxDir); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _, _ = testenv.Docker(context.Background(), "rmi", "-f", tag) })
	return tag
}

// pushSlow is Registry.Push without its 2-minute bound: a busy machine
// compresses hundreds of MB on one core.
func pushSlow(b *testing.B, reg *testenv.Registry, local, repo string) string {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	ref := reg.Addr + "/" + repo
	cfg := b.TempDir()
	for _, s := range [][]string{
		{"tag", local, ref},
		{"--config", cfg, "login", "-u", reg.Username, "-p", reg.Password, reg.Addr},
		{"--config", cfg, "push", ref},
		{"rmi", ref, local}, // a pull must download every layer but the base
	} {
		if _, err := testenv.Docker(ctx, s...); err != nil {
			b.Fatal(err)
		}
	}
	return ref
}

// BenchmarkFastPullColdVsDockerPull is the same race on the cold registry
// (TLS, its link capped: 100 Mbit/s per connection, 1 Gbit/s in all) with
// the full cold image (~1.5 GB compressed, 6 layers, one half of it).
// TANDEM_FAST_PULL_COLD_IMAGE=small|onelayer picks another.
func BenchmarkFastPullColdVsDockerPull(b *testing.B) {
	kind := testenv.ColdFull
	if k := os.Getenv("TANDEM_FAST_PULL_COLD_IMAGE"); k != "" {
		kind = testenv.ColdImageKind(k)
	}
	reg := testenv.StartColdRegistry(b, testenv.ColdOptions{})
	img := testenv.BuildColdImage(b, kind)
	ref := reg.AddImage(b, img, "tandem/cold-bench:v1")
	rt, err := dockerrt.New()
	if err != nil {
		b.Fatal(err)
	}
	defer rt.Close()
	p := fastpull.New(fastpull.Config{Enabled: true, TempDir: b.TempDir()}, rt.Client(), slog.New(slog.NewTextHandler(os.Stderr, nil)))
	var fast, docker time.Duration
	for range b.N {
		docker += timePull(b, ref, func(ctx context.Context) (io.ReadCloser, error) { return rt.Pull(ctx, ref, task.RegistryAuth{}) })
		fast += timePull(b, ref, func(ctx context.Context) (io.ReadCloser, error) {
			return p.Pull(ctx, ref, task.RegistryAuth{}, func(context.Context, string, task.RegistryAuth) (io.ReadCloser, error) {
				return nil, fmt.Errorf("the fast path fell back")
			})
		})
	}
	b.ReportMetric(docker.Seconds()/float64(b.N), "docker-s/op")
	b.ReportMetric(fast.Seconds()/float64(b.N), "fast-s/op")
	b.ReportMetric(fast.Seconds()/docker.Seconds(), "fast/docker")
	b.ReportMetric(float64(img.Size())/reg.LinkBytesPerSecond(), "link-floor-s")
}
