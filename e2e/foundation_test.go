// Package e2e holds end-to-end tests: the real binaries against a real Docker
// daemon, real images built locally, real OpenSSH and loop devices.
package e2e

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/common/version"
	"github.com/tandem-run/tandem/e2e/testenv"
)

// versionRe is a final dstack release: exactly what the server compares.
var versionRe = regexp.MustCompile(`^\d+\.\d+\.\d+$`)

func TestBusyboxImageRunsAsEachUser(t *testing.T) {
	img := testenv.Busybox(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, tc := range []struct{ user, want string }{
		{"root", "uid=0(root) gid=0(root)"},
		{"user", "uid=1000(user) gid=1000(user)"},
	} {
		out, err := testenv.Docker(ctx, "run", "--rm", "--user", tc.user, img, "sh", "-c", "id; echo home=$HOME")
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(out, tc.want) {
			t.Fatalf("user %s: got %q, want prefix %q", tc.user, out, tc.want)
		}
	}
}

// The runner is bind-mounted into arbitrary images, so it must be static: it
// has to start in an image with no libc at all.
func TestStaticRunnerStartsInScratchImage(t *testing.T) {
	img := testenv.Busybox(t)
	bins := testenv.Binaries(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := testenv.Docker(ctx, "run", "--rm", "-v", bins.Runner+":/usr/local/bin/dstack-runner:ro", img,
		"/usr/local/bin/dstack-runner", "--version")
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(out)
	if len(f) != 3 || f[0] != "dstack-runner" || f[1] != "version" || !versionRe.MatchString(f[2]) {
		t.Fatalf("--version in a scratch image printed %q; the shim's component manager needs `dstack-runner version <v>`", out)
	}
}

func TestDebianImage(t *testing.T) {
	img := testenv.Debian(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := testenv.Docker(ctx, "run", "--rm", img, "sh", "-c", "cat /etc/debian_version; getent passwd root")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(out, "12.") || !strings.Contains(out, "root:x:0:0:") {
		t.Fatalf("unexpected Debian image: %q", out)
	}
}

func TestAgentVersionsAreThreeWords(t *testing.T) {
	bins := testenv.Binaries(t)
	for name, path := range map[string]string{"dstack-shim": bins.Shim, "dstack-runner": bins.Runner} {
		out, err := exec.Command(path, "--version").Output()
		if err != nil {
			t.Fatalf("%s --version: %v", name, err)
		}
		f := strings.Fields(string(out))
		if len(f) != 3 || f[0] != name || f[1] != "version" || !versionRe.MatchString(f[2]) {
			t.Fatalf("%s --version printed %q", name, out)
		}
		// The default build reports the protocol level we implement.
		if f[2] != version.ProtocolLevel {
			t.Fatalf("%s reports %s; want %s", name, f[2], version.ProtocolLevel)
		}
	}
}

// A shim built without cgo cannot load NVML: it still builds, serves, and
// says why it sees no NVIDIA GPUs.
func TestShimWithoutCgoExplainsNoNVIDIA(t *testing.T) {
	testenv.RequireDocker(t)
	bin := filepath.Join(t.TempDir(), "dstack-shim")
	build := exec.Command("go", "build", "-o", bin, "./cmd/dstack-shim")
	build.Dir = filepath.Join("..")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("CGO_ENABLED=0 build: %v\n%s", err, out)
	}
	_, port, _ := net.SplitHostPort(testenv.FreeAddr(t))
	home := t.TempDir()
	testenv.UnmountUnder(t, home)
	cmd := exec.Command(bin, "--shim-home", home, "--shim-http-port", port, "--runner-binary-path", testenv.Binaries(t).Runner)
	testenv.Isolate(cmd)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, _ := os.ReadFile(filepath.Join(home, "shim.log"))
		if strings.Contains(string(b), "shim API serving") {
			if !strings.Contains(string(b), "built without cgo, so NVML cannot be loaded") {
				t.Fatalf("no reason logged:\n%s", b)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("shim did not start:\n%s", b)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
