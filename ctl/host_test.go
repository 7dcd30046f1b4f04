package ctl

import (
	"strings"
	"testing"
)

// TestHostProbe: what the probe prints decides the install: architecture,
// root or sudo, systemd, and a clear refusal without a working Docker.
func TestHostProbe(t *testing.T) {
	for _, tc := range []struct {
		out, err, dockerErr string
		arch                string
		sudo, systemd       bool
	}{
		{out: "arch=x86_64\nuid=0\nsystemd=1\ndocker=26.1.5\n", arch: "amd64", systemd: true},
		{out: "arch=aarch64\nuid=1000\nsystemd=0\ndocker=20.10.24\nsudo=1\n", arch: "arm64", sudo: true},
		{out: "arch=riscv64\nuid=0\n", err: `architecture "riscv64" is not supported`},
		{out: "arch=x86_64\nuid=1000\nsudo=0\ndocker=1\n", err: "no passwordless sudo"},
		{out: "arch=x86_64\nuid=0\nsystemd=1\ndocker_error=Cannot connect to the Docker daemon at unix:///var/run/docker.sock. \n",
			arch: "amd64", systemd: true, dockerErr: "has no working Docker (Cannot connect to the Docker daemon"},
		{out: "arch=x86_64\nuid=0\ndocker_error=no docker command and no /var/run/docker.sock\n", arch: "amd64",
			dockerErr: "install it first (Debian/Ubuntu: apt-get install docker.io)"},
	} {
		h := &remoteHost{}
		err := h.parseProbe(tc.out)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%q: error %v, want %q", tc.out, err, tc.err)
			}
			continue
		}
		if err != nil || h.arch != tc.arch || h.sudo != tc.sudo || h.systemd != tc.systemd {
			t.Errorf("%q: %+v %v", tc.out, h, err)
		}
		derr := h.requireDocker()
		if (tc.dockerErr == "") != (derr == nil) || derr != nil && !strings.Contains(derr.Error(), tc.dockerErr) {
			t.Errorf("%q: docker %v, want %q", tc.out, derr, tc.dockerErr)
		}
	}
}

func TestGlibcCheck(t *testing.T) {
	for _, tc := range []struct {
		a, b string
		less bool
	}{{"2.9", "2.31", true}, {"2.31", "2.31", false}, {"2.34", "2.31", false}, {"2.31", "2.31.1", true}, {"3", "2.99", false}} {
		if got := versionLess(tc.a, tc.b); got != tc.less {
			t.Errorf("versionLess(%s, %s) = %v", tc.a, tc.b, got)
		}
	}
	// A binary of this machine's (glibc, dynamically linked) needs some
	// GLIBC_ version; a host without glibc or with an older one is refused.
	need, err := glibcNeeded("/bin/ls")
	if err != nil || need == "" {
		t.Fatalf("glibcNeeded(/bin/ls) = %q, %v", need, err)
	}
	h := &remoteHost{glibc: ""}
	if err := h.canRun("/bin/ls"); err == nil || !strings.Contains(err.Error(), "has no glibc") {
		t.Fatalf("no glibc: %v", err)
	}
	h.glibc = "2.1"
	if err := h.canRun("/bin/ls"); err == nil || !strings.Contains(err.Error(), "needs glibc "+need+", the host has 2.1") {
		t.Fatalf("old glibc: %v", err)
	}
	h.glibc = need
	if err := h.canRun("/bin/ls"); err != nil {
		t.Fatal(err)
	}
	var probe remoteHost
	if err := probe.parseProbe("arch=x86_64\nuid=0\nglibc=glibc 2.31\nsystemd=1\n"); err != nil || probe.glibc != "2.31" {
		t.Fatalf("probe: %+v %v", probe, err)
	}
}
