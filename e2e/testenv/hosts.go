package testenv

import (
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Host is a machine of its own on this one, for multi-node tests: a
// network namespace with its own hostname, dockerd, sshd and (StartShim)
// shim. A host-network container of its dockerd sees the namespace as its
// host, as on a VM. The hosts of one Hosts call share a network (eth0,
// ClusterIP); the test reaches each over its own link (up0, UplinkIP), as
// a laptop reaches cloud VMs at addresses the VMs do not share.
type Host struct {
	Name       string // hostname, and the network namespace's name
	ClusterIP  string // on eth0, the network the hosts share
	UplinkIP   string // on up0, the test's link to this host
	DockerHost string // unix://… of its dockerd
	SSHD       *SSHD  // listening on UplinkIP:22
	dir        string
}

// Wrap is the argv prefix that runs a command inside the host: its network
// namespace and a UTS namespace with its hostname. Not `ip netns exec`: it
// mounts a fresh /sys, hiding the cgroup mounts dockerd needs.
func (h *Host) Wrap() []string {
	return []string{"nsenter", "--net=/run/netns/" + h.Name, "unshare", "--uts", "--", "sh", "-c", `hostname "$0" && exec "$@"`, h.Name}
}

// Command is exec.Command inside the host, with its DOCKER_HOST.
func (h *Host) Command(name string, args ...string) *exec.Cmd {
	argv := append(h.Wrap(), append([]string{name}, args...)...)
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), "DOCKER_HOST="+h.DockerHost)
	return cmd
}

// Docker runs the docker CLI against the host's dockerd.
func (h *Host) Docker(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "docker", args...)
	cmd.Env = append(os.Environ(), "DOCKER_HOST="+h.DockerHost)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("docker %s: %w: %s", strings.Join(args, " "), err, tail(out, 10))
	}
	return string(out), nil
}

// Hosts makes two hosts joined by a veth pair (10.213.N.2 and .3/24), each
// with an uplink to this namespace (10.214.N.2/30 and .6/30), its own
// dockerd (never --bridge=none: its docker0 is its own) and sshd. All of
// it goes with the test.
func Hosts(t *testing.T) []*Host {
	t.Helper()
	RequireDocker(t)
	if os.Geteuid() != 0 {
		if InCI() {
			t.Fatal("CI runs as root")
		}
		t.Skip("network namespaces need root")
	}
	var b [2]byte
	_, _ = rand.Read(b[:])
	n := 1 + int(b[0])%250
	tag := fmt.Sprintf("%02x%02x", b[0], b[1])
	hosts := make([]*Host, 2)
	ip := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v %s", strings.Join(args, " "), err, out)
		}
	}
	for i := range hosts {
		h := &Host{Name: fmt.Sprintf("tdm%s-node%d", tag, i), ClusterIP: fmt.Sprintf("10.213.%d.%d", n, 2+i), UplinkIP: fmt.Sprintf("10.214.%d.%d", n, 2+4*i)}
		hosts[i] = h
		ip("netns", "add", h.Name)
		t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", h.Name).Run() })
		ip("-n", h.Name, "link", "set", "lo", "up")
		up := fmt.Sprintf("tdm%su%d", tag, i)
		ip("link", "add", up, "type", "veth", "peer", "name", "up0", "netns", h.Name)
		t.Cleanup(func() { _ = exec.Command("ip", "link", "del", up).Run() })
		ip("addr", "add", fmt.Sprintf("10.214.%d.%d/30", n, 1+4*i), "dev", up)
		ip("link", "set", up, "up")
		ip("-n", h.Name, "addr", "add", h.UplinkIP+"/30", "dev", "up0")
		ip("-n", h.Name, "link", "set", "up0", "up")
	}
	a, z := "tdm"+tag+"c0", "tdm"+tag+"c1"
	ip("link", "add", a, "netns", hosts[0].Name, "type", "veth", "peer", "name", z, "netns", hosts[1].Name)
	for i, dev := range []string{a, z} {
		h := hosts[i]
		ip("-n", h.Name, "link", "set", dev, "name", "eth0")
		ip("-n", h.Name, "addr", "add", h.ClusterIP+"/24", "dev", "eth0")
		ip("-n", h.Name, "link", "set", "eth0", "up")
	}
	for _, h := range hosts {
		h.startDockerd(t)
		h.SSHD = StartSSHDAt(t, h.UplinkIP+":22", h.Wrap())
	}
	return hosts
}

func (h *Host) startDockerd(t *testing.T) {
	t.Helper()
	d := StartDockerd(t, h.Wrap(), time.Minute)
	h.dir, h.DockerHost = d.Dir, d.Host
	// Before the daemon dies: its containers (their runc shims live on
	// outside its process group).
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if out, err := h.Docker(ctx, "ps", "-aq"); err == nil && strings.TrimSpace(out) != "" {
			_, _ = h.Docker(ctx, append([]string{"rm", "-f"}, strings.Fields(out)...)...)
		}
	})
}

// StartShim runs the shim inside the host on its default port 10998 (as
// the dstack server and tandem --ssh expect it) and waits until it serves.
func (h *Host) StartShim(t *testing.T, shim, runner string, args ...string) {
	t.Helper()
	home := filepath.Join(h.dir, "shim-home")
	argv := append([]string{"--shim-home", home, "--runner-binary-path", runner, "--shim-log-level", "debug"}, args...)
	cmd := h.Command(shim, argv...)
	_ = os.MkdirAll(home, 0o755)
	logf, _ := os.Create(filepath.Join(h.dir, "shim.stderr"))
	cmd.Stdout, cmd.Stderr = logf, logf
	t.Cleanup(func() { logf.Close() })
	StartDaemon(t, cmd)
	deadline := time.Now().Add(30 * time.Second)
	for {
		// Asked from inside: the shim answers on the host's loopback.
		if h.Command("bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/10998").Run() == nil {
			return
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(filepath.Join(h.dir, "shim.stderr"))
			t.Fatalf("%s: shim did not serve:\n%s", h.Name, tail(b, 30))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// Log is the tail of one of the host's daemon logs ("dockerd.log",
// "shim.stderr"), for failure messages.
func (h *Host) Log(name string) string {
	b, _ := os.ReadFile(filepath.Join(h.dir, name))
	return tail(b, 40)
}

// ImportImage loads a rootfs tarball into the host's dockerd as tag.
func (h *Host) ImportImage(t *testing.T, tarball, tag string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	if _, err := h.Docker(ctx, "image", "inspect", tag); err == nil {
		return
	}
	if _, err := h.Docker(ctx, "import", "--change", `CMD ["/bin/bash"]`, tarball, tag); err != nil {
		t.Fatalf("%s: %v", h.Name, err)
	}
}

// MPIRootfs returns a tarball of a Debian bookworm rootfs with Open MPI,
// PyTorch and the OpenSSH client (no sshd), built with debootstrap once and
// cached beside the plain Debian one.
func MPIRootfs(t testing.TB) string {
	t.Helper()
	unlock := lockImages(t)
	defer unlock()
	return debootstrapTarball(t, "debian-bookworm-mpi.tar", "openmpi-bin,openssh-client,python3-torch", true)
}
