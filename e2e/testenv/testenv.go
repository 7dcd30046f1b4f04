// Package testenv gives end-to-end tests their real parts: a Docker daemon
// (required in CI), locally built test images (no registry is reachable),
// and the three binaries.
package testenv

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Image tags of the locally built test images.
const (
	BusyboxImage = "tandem-test/busybox"
	DebianImage  = "tandem-test/debian:bookworm"
)

// InCI reports whether we run under CI, where skips are failures.
func InCI() bool { return os.Getenv("CI") == "true" }

// RequireDocker skips the test when no Docker daemon answers, except in CI,
// where it fails: a skipped e2e test there would hide a broken set-up.
func RequireDocker(t testing.TB) {
	t.Helper()
	if testing.Short() && !InCI() {
		t.Skip("e2e test skipped in -short mode")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "docker", "info", "--format", "{{.ServerVersion}}").CombinedOutput()
	if err == nil {
		return
	}
	msg := fmt.Sprintf("docker is not available (%v: %s); run `make deps`", err, bytes.TrimSpace(out))
	if InCI() {
		t.Fatal(msg)
	}
	t.Skip(msg)
}

// Docker runs the docker CLI and returns its stdout; stderr goes into the error.
func Docker(ctx context.Context, args ...string) (string, error) {
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, "docker", args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("docker %s: %w: %s", strings.Join(args, " "), err, bytes.TrimSpace(stderr.Bytes()))
	}
	return stdout.String(), nil
}

// lockImages serializes image builds across test processes (go test runs
// packages in parallel).
func lockImages(t testing.TB) func() {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(os.TempDir(), "tandem-e2e-images.lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatalf("image lock: %v", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatalf("image lock: %v", err)
	}
	return func() {
		_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
		f.Close()
	}
}

func imageExists(ctx context.Context, ref string) bool {
	_, err := Docker(ctx, "image", "inspect", "--format", "{{.Id}}", ref)
	return err == nil
}

const passwd = `root:x:0:0:root:/root:/bin/sh
daemon:x:1:1:daemon:/usr/sbin:/bin/false
user:x:1000:1000:Test User:/home/user:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
`

const group = `root:x:0:
daemon:x:1:
users:x:100:user
user:x:1000:
nogroup:x:65534:
`

// Busybox returns the tag of a tiny image built FROM scratch with the host's
// static busybox and a passwd/group with root, user (1000) and nobody. The
// tag carries a hash of the inputs, so a changed busybox rebuilds it.
func Busybox(t testing.TB) string {
	t.Helper()
	RequireDocker(t)
	bb, err := exec.LookPath("busybox")
	if err != nil {
		bb = "/bin/busybox"
	}
	bin, err := os.ReadFile(bb)
	if err != nil {
		t.Fatalf("read busybox (install busybox-static): %v", err)
	}
	dockerfile := "FROM scratch\nCOPY busybox /bin/busybox\nRUN [\"/bin/busybox\", \"--install\", \"-s\", \"/bin\"]\n" +
		"COPY passwd group /etc/\nRUN mkdir -p /root /home/user /tmp /usr/local/bin && chmod 1777 /tmp && chown 1000:1000 /home/user\n" +
		"ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\nCMD [\"/bin/sh\"]\n"
	h := sha256.New()
	h.Write(bin)
	h.Write([]byte(dockerfile + passwd + group))
	tag := BusyboxImage + ":" + hex.EncodeToString(h.Sum(nil))[:12]

	ctx := context.Background()
	unlock := lockImages(t)
	defer unlock()
	if imageExists(ctx, tag) {
		return tag
	}
	dir := t.TempDir()
	for name, data := range map[string][]byte{"busybox": bin, "Dockerfile": []byte(dockerfile), "passwd": []byte(passwd), "group": []byte(group)} {
		mode := os.FileMode(0o644)
		if name == "busybox" {
			mode = 0o755
		}
		if err := os.WriteFile(filepath.Join(dir, name), data, mode); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := Docker(ctx, "build", "-q", "-t", tag, dir); err != nil {
		t.Fatalf("build busybox image: %v", err)
	}
	return tag
}

// Debian returns the tag of a realistic Debian bookworm image made with
// `debootstrap --variant=minbase` and `docker import`. The rootfs tarball is
// cached so a pruned Docker does not re-run debootstrap.
func Debian(t testing.TB) string {
	t.Helper()
	RequireDocker(t)
	ctx := context.Background()
	unlock := lockImages(t)
	defer unlock()
	if imageExists(ctx, DebianImage) {
		return DebianImage
	}
	tarball := debootstrapTarball(t, "debian-bookworm-minbase.tar", "", false)
	if _, err := Docker(ctx, "import", "--change", `CMD ["/bin/bash"]`, tarball, DebianImage); err != nil {
		t.Fatalf("import debian image: %v", err)
	}
	return DebianImage
}

// debootstrapTarball returns the cached tarball name of a Debian bookworm
// minbase rootfs with the include packages (comma-separated, "" for none),
// running debootstrap once (the cache: $TANDEM_E2E_CACHE, else
// /var/cache/tandem-e2e; the mirror: $TANDEM_DEBIAN_MIRROR). prune leaves
// out docs, manuals, locales and apt's caches. Callers hold lockImages.
func debootstrapTarball(t testing.TB, name, include string, prune bool) string {
	t.Helper()
	cacheDir := os.Getenv("TANDEM_E2E_CACHE")
	if cacheDir == "" {
		cacheDir = "/var/cache/tandem-e2e"
	}
	if err := os.MkdirAll(cacheDir, 0o755); err != nil {
		t.Fatalf("cache dir: %v", err)
	}
	tarball := filepath.Join(cacheDir, name)
	if _, err := os.Stat(tarball); err == nil {
		return tarball
	}
	mirror := os.Getenv("TANDEM_DEBIAN_MIRROR")
	if mirror == "" {
		mirror = "http://deb.debian.org/debian"
	}
	rootfs := tarball + ".rootfs.tmp"
	_ = os.RemoveAll(rootfs)
	defer os.RemoveAll(rootfs)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	args := []string{"--variant=minbase"}
	if include != "" {
		args = append(args, "--include="+include)
	}
	t.Logf("debootstrap bookworm minbase%s from %s (one-time, cached in %s)", strings.TrimRight(" +"+include, " +"), mirror, cacheDir)
	start := time.Now()
	out, err := exec.CommandContext(ctx, "debootstrap", append(args, "bookworm", rootfs, mirror)...).CombinedOutput()
	if err != nil {
		t.Fatalf("debootstrap: %v\n%s", err, tail(out, 20))
	}
	if prune {
		for _, junk := range []string{"usr/share/doc", "usr/share/man", "usr/share/locale", "var/cache/apt", "var/lib/apt/lists"} {
			_ = os.RemoveAll(filepath.Join(rootfs, junk))
		}
	}
	tmp := tarball + ".tmp"
	if out, err := exec.CommandContext(ctx, "tar", "-C", rootfs, "--numeric-owner", "-cf", tmp, ".").CombinedOutput(); err != nil {
		t.Fatalf("tar rootfs: %v: %s", err, out)
	}
	if err := os.Rename(tmp, tarball); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s built in %s", name, time.Since(start).Round(time.Second))
	return tarball
}

func tail(b []byte, n int) string {
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// Bins holds the paths of the built binaries.
type Bins struct {
	Shim, Runner, Tandem string
}

var (
	buildOnce sync.Once
	buildBins Bins
	buildErr  error
)

// Binaries returns the binaries from $TANDEM_BIN (what `make test` built), or
// builds them once per test process, the runner static as in release.
func Binaries(t testing.TB) Bins {
	t.Helper()
	buildOnce.Do(func() {
		dir := os.Getenv("TANDEM_BIN")
		if dir == "" {
			dir, buildErr = os.MkdirTemp("", "tandem-bin-")
			if buildErr != nil {
				return
			}
			root := moduleRoot()
			for _, b := range []struct{ name, cgo string }{{"dstack-runner", "0"}, {"dstack-shim", "1"}, {"tandem", "1"}} {
				cmd := exec.Command("go", "build", "-trimpath", "-o", filepath.Join(dir, b.name), "./cmd/"+b.name)
				cmd.Dir = root
				cmd.Env = append(os.Environ(), "CGO_ENABLED="+b.cgo, "CGO_CFLAGS=-O2 -Wno-deprecated-declarations")
				if out, err := cmd.CombinedOutput(); err != nil {
					buildErr = fmt.Errorf("build %s: %w\n%s", b.name, err, out)
					return
				}
			}
		}
		buildBins = Bins{Shim: filepath.Join(dir, "dstack-shim"), Runner: filepath.Join(dir, "dstack-runner"), Tandem: filepath.Join(dir, "tandem")}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return buildBins
}

func moduleRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}

var (
	distOnce sync.Once
	distDir  string
	distErr  error
)

// Dist returns the release tree's binaries directory for version
// ProtocolLevel: $TANDEM_DIST/binaries (what `make test` built with
// `make release`), or a tree built once per test process.
func Dist(t testing.TB, version string) string {
	t.Helper()
	distOnce.Do(func() {
		if d := os.Getenv("TANDEM_DIST"); d != "" {
			distDir = filepath.Join(d, "binaries")
			return
		}
		out, err := os.MkdirTemp("", "tandem-dist-")
		if err != nil {
			distErr = err
			return
		}
		cmd := exec.Command("./scripts/release.sh", version, out)
		cmd.Dir = moduleRoot()
		if b, err := cmd.CombinedOutput(); err != nil {
			distErr = fmt.Errorf("release build: %w\n%s", err, b)
			return
		}
		distDir = filepath.Join(out, version, "binaries")
	})
	if distErr != nil {
		t.Fatal(distErr)
	}
	return distDir
}

// ModuleRoot is the repository's root directory.
func ModuleRoot() string { return moduleRoot() }

// Tail is the last n lines of b.
func Tail(b []byte, n int) string { return tail(b, n) }

// UnmountUnder detaches, when the test ends, every mount below dir: a shim
// home's runner dirs are filesystems of their own, which the shim keeps
// mounted across its restarts (the tasks' containers hold them), so the
// temp dir could not be removed otherwise. Call it right after making the
// home, before starting the shim: cleanups run last-in first-out, so it
// runs after the shim and its containers are gone.
func UnmountUnder(t testing.TB, dir string) {
	t.Cleanup(func() {
		b, err := os.ReadFile("/proc/self/mountinfo")
		if err != nil {
			return
		}
		prefix := filepath.Clean(dir) + "/"
		var points []string
		for _, line := range strings.Split(string(b), "\n") {
			f := strings.Fields(line)
			if len(f) > 4 && strings.HasPrefix(f[4], prefix) {
				points = append(points, f[4])
			}
		}
		// Deepest first.
		sort.Slice(points, func(i, j int) bool { return len(points[i]) > len(points[j]) })
		for _, p := range points {
			_ = unix.Unmount(p, unix.MNT_DETACH)
		}
	})
}
