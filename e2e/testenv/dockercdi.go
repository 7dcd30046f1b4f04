package testenv

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// CDIDockerSuite is the Debian release whose Docker the CDI tests run: the
// machine's own (bookworm's 20.10) predates CDI device requests, trixie's
// 26 takes them under features.cdi.
const CDIDockerSuite = "trixie"

// CDIDocker returns a directory to put first on dockerd's PATH: dockerd,
// containerd and its runc shim from Debian's CDIDockerSuite, fetched with
// scripts/debian-fetch.sh (the machine's apt state untouched) once per
// machine, beside the machine's runc (the newer suite's needs a newer libc)
// and docker-init.
func CDIDocker(t testing.TB) string {
	t.Helper()
	return machineCache(t, "tandem-docker-"+CDIDockerSuite, func(dir string) {
		root, err := os.MkdirTemp("", "tandem-docker-fetch-")
		if err != nil {
			t.Fatal(err)
		}
		defer os.RemoveAll(root)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer cancel()
		fetch := exec.CommandContext(ctx, filepath.Join(moduleRoot(), "scripts", "debian-fetch.sh"), CDIDockerSuite, root, "docker.io", "containerd")
		if out, err := fetch.CombinedOutput(); err != nil {
			t.Fatalf("fetch Docker from Debian %s: %v\n%s", CDIDockerSuite, err, tail(out, 20))
		}
		for _, b := range []string{"usr/sbin/dockerd", "usr/bin/containerd", "usr/bin/containerd-shim-runc-v2"} {
			if err := os.Rename(filepath.Join(root, b), filepath.Join(dir, filepath.Base(b))); err != nil {
				t.Fatal(err)
			}
		}
		for _, b := range []string{"runc", "docker-init"} {
			p, err := exec.LookPath(b)
			if err != nil {
				t.Fatalf("%s: %v", b, err)
			}
			if err := os.Symlink(p, filepath.Join(dir, b)); err != nil {
				t.Fatal(err)
			}
		}
	})
}
