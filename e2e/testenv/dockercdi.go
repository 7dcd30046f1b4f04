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
// apt's own client (private lists, the machine's apt state untouched) once
// per machine, beside the machine's runc (the newer suite's needs a newer
// libc) and docker-init.
func CDIDocker(t testing.TB) string {
	t.Helper()
	return machineCache(t, "tandem-docker-"+CDIDockerSuite, func(dir string) {
		work, err := os.MkdirTemp("", "tandem-docker-fetch-")
		if err != nil {
			t.Fatal(err)
		}
		defer os.RemoveAll(work)
		for _, d := range []string{"lists/partial", "cache/archives/partial", "debs", "root"} {
			if err := os.MkdirAll(filepath.Join(work, d), 0o755); err != nil {
				t.Fatal(err)
			}
		}
		sources := filepath.Join(work, "sources.list")
		if err := os.WriteFile(sources, []byte("deb http://deb.debian.org/debian "+CDIDockerSuite+" main\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer cancel()
		apt := []string{"-o", "Dir::Etc::SourceList=" + sources, "-o", "Dir::Etc::SourceParts=/dev/null",
			"-o", "Dir::State::Lists=" + filepath.Join(work, "lists"), "-o", "Dir::Cache=" + filepath.Join(work, "cache"),
			"-o", "APT::Sandbox::User=root", "-qq"}
		run := func(cwd string, name string, args ...string) {
			t.Helper()
			cmd := exec.CommandContext(ctx, name, args...)
			cmd.Dir = cwd
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("%s %v: %v\n%s", name, args, err, tail(out, 20))
			}
		}
		run(work, "apt-get", append(apt, "update")...)
		run(filepath.Join(work, "debs"), "apt-get", append(apt, "download", "docker.io", "containerd")...)
		debs, _ := filepath.Glob(filepath.Join(work, "debs", "*.deb"))
		for _, d := range debs {
			run(work, "dpkg", "-x", d, filepath.Join(work, "root"))
		}
		for _, b := range []string{"usr/sbin/dockerd", "usr/bin/containerd", "usr/bin/containerd-shim-runc-v2"} {
			run(work, "cp", filepath.Join(work, "root", b), dir)
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
