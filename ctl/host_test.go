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
		h := &host{}
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
