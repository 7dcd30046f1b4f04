package testenv

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Real VMs for the deployment tests: a Debian 12 guest built locally
// (scripts/vm-image.sh, cached), booted with QEMU in software emulation
// (TCG; this machine's /dev/kvm does not boot stock kernels). The guest's
// network is QEMU user mode with restrict=on: it reaches nothing but the
// forwards set here, SSH in from the test and 10.0.2.100:80 out to one
// server on this machine's loopback (GuestServer).

// GuestAddr is where a guest reaches the test's GuestServer.
const GuestAddr = "10.0.2.100"

// GuestImage is a guest's kernel, initrd and root filesystem (raw ext4,
// booted as /dev/vda).
type GuestImage struct {
	Kernel, Initrd, Root string
}

var guestImageMu sync.Mutex

// Guest returns the guest image variant (full, nocurl, nodocker), built on
// first use and cached under $TANDEM_E2E_CACHE (/var/cache/tandem-e2e).
func Guest(t testing.TB, variant string) GuestImage {
	t.Helper()
	RequireQEMU(t)
	guestImageMu.Lock()
	defer guestImageMu.Unlock()
	cache := os.Getenv("TANDEM_E2E_CACHE")
	if cache == "" {
		cache = "/var/cache/tandem-e2e"
	}
	dir := filepath.Join(cache, "vm")
	img := GuestImage{Kernel: filepath.Join(dir, "vmlinuz"), Initrd: filepath.Join(dir, "initrd.img"), Root: filepath.Join(dir, variant+".img")}
	if _, err := os.Stat(img.Root); err == nil {
		return img
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(moduleRoot(), "scripts", "vm-image.sh"), dir, variant)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("vm-image.sh %s: %v\n%s", variant, err, tail(out, 30))
	}
	t.Logf("guest image %s built in %s", variant, time.Since(start).Round(time.Second))
	return img
}

// RequireQEMU fails (CI) or skips the test where QEMU is missing.
func RequireQEMU(t testing.TB) {
	t.Helper()
	for _, tool := range []string{"qemu-system-x86_64", "qemu-img", "genisoimage", "socat", "debootstrap", "ssh-keyscan"} {
		if _, err := exec.LookPath(tool); err != nil {
			if InCI() {
				t.Fatalf("%s missing (make deps installs it)", tool)
			}
			t.Skipf("%s missing (make deps installs it)", tool)
		}
	}
}

// GuestServer serves what a guest may fetch, at http://10.0.2.100/:
// /files/<name> from files, and /debian/ as a proxy of the Debian mirror
// ($TANDEM_DEBIAN_MIRROR), for apt in the guest. It returns the loopback
// port a VM forwards to.
func GuestServer(t testing.TB, files map[string]string) int {
	t.Helper()
	mirror := os.Getenv("TANDEM_DEBIAN_MIRROR")
	if mirror == "" {
		mirror = "http://deb.debian.org/debian"
	}
	up, err := url.Parse(mirror)
	if err != nil {
		t.Fatal(err)
	}
	proxy := &httputil.ReverseProxy{Rewrite: func(r *httputil.ProxyRequest) {
		r.Out.URL.Path = strings.TrimPrefix(r.In.URL.Path, "/debian")
		r.Out.URL.RawPath = ""
		r.SetURL(up)
		r.Out.Host = up.Host
	}}
	mux := http.NewServeMux()
	mux.Handle("/debian/", proxy)
	mux.HandleFunc("/files/", func(w http.ResponseWriter, r *http.Request) {
		p, ok := files[strings.TrimPrefix(r.URL.Path, "/files/")]
		if !ok {
			http.NotFound(w, r)
			return
		}
		http.ServeFile(w, r, p)
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return ln.Addr().(*net.TCPAddr).Port
}

// VM is one booted guest.
type VM struct {
	t       testing.TB
	dir     string
	SSHPort int
	User    string // the image's default user (cloud-init), with sudo
	// ClientKey is the private key the guest accepts once user-data holds
	// PublicKey; KnownHosts has the guest's host keys once it is up.
	ClientKey, PublicKey, KnownHosts string
	console                          string
	qemu                             *exec.Cmd
	boot                             BootOptions // the last Boot's, for a restart
	restarted                        bool
}

// NewVM prepares a VM's directory and SSH key; Boot starts it.
func NewVM(t testing.TB) *VM {
	t.Helper()
	RequireQEMU(t)
	dir := t.TempDir()
	v := &VM{t: t, dir: dir, User: "debian", ClientKey: filepath.Join(dir, "id_ed25519"), KnownHosts: filepath.Join(dir, "known_hosts"),
		console: filepath.Join(dir, "console.log")}
	v.PublicKey = KeyGen(t, v.ClientKey, "ed25519")
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("guest console (last lines):\n%s", v.ConsoleTail(40))
		}
	})
	return v
}

// BootOptions is what a VM boots from.
type BootOptions struct {
	Disk, DiskFormat string // the base disk (raw or qcow2); the VM writes to an overlay
	Kernel, Initrd   string // direct kernel boot (the test images have no boot loader)
	UserData         string // NoCloud user-data; empty: no seed
	ServerPort       int    // loopback port that 10.0.2.100:80 reaches; 0: none
	MemoryMiB, CPUs  int    // default 2048, 2
}

// Boot starts the VM (its own process group, killed at cleanup) and
// returns once its SSH port is forwarded; WaitSSH waits for the guest.
func (v *VM) Boot(o BootOptions) {
	t := v.t
	t.Helper()
	if o.MemoryMiB == 0 {
		o.MemoryMiB = 2048
	}
	if o.CPUs == 0 {
		o.CPUs = 2
	}
	v.boot = o
	overlay := filepath.Join(v.dir, "disk.qcow2")
	_ = os.Remove(overlay)
	_ = os.Remove(v.console)
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-F", o.DiskFormat, "-b", o.Disk, overlay).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img: %v %s", err, out)
	}
	v.SSHPort = FreePort(t)
	netdev := fmt.Sprintf("user,id=n0,restrict=on,hostfwd=tcp:127.0.0.1:%d-:22", v.SSHPort)
	if o.ServerPort != 0 {
		netdev += fmt.Sprintf(",guestfwd=tcp:%s:80-cmd:socat - TCP:127.0.0.1:%d", GuestAddr, o.ServerPort)
	}
	args := []string{"-accel", "tcg", "-m", strconv.Itoa(o.MemoryMiB), "-smp", strconv.Itoa(o.CPUs), "-nodefaults", "-display", "none",
		"-serial", "file:" + v.console, "-drive", "file=" + overlay + ",if=virtio,format=qcow2,discard=unmap",
		"-netdev", netdev, "-device", "virtio-net-pci,netdev=n0,romfile=", "-device", "virtio-rng-pci"}
	if o.Kernel != "" {
		args = append(args, "-kernel", o.Kernel, "-initrd", o.Initrd, "-append", "root=/dev/vda rw console=ttyS0")
	}
	if o.UserData != "" {
		files := NoCloudSeed(t, filepath.Join(v.dir, "seed"), o.UserData, filepath.Base(v.dir), "tandem-vm")
		iso := filepath.Join(v.dir, "seed.iso")
		if out, err := exec.Command("genisoimage", append([]string{"-quiet", "-output", iso, "-volid", "cidata", "-joliet", "-rock"},
			files...)...).CombinedOutput(); err != nil {
			t.Fatalf("genisoimage: %v %s", err, out)
		}
		args = append(args, "-drive", "file="+iso+",if=virtio,format=raw,readonly=on")
	}
	cmd := exec.Command("qemu-system-x86_64", args...)
	logf, err := os.Create(filepath.Join(v.dir, "qemu.log"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { logf.Close() })
	cmd.Stdout, cmd.Stderr = logf, logf
	StartDaemon(t, cmd)
	v.qemu = cmd
}

// exited reports QEMU's own output when it is no longer running.
func (v *VM) exited() (string, bool) {
	if v.qemu == nil || v.qemu.Process == nil || syscall.Kill(v.qemu.Process.Pid, 0) == nil {
		return "", false
	}
	b, _ := os.ReadFile(filepath.Join(v.dir, "qemu.log"))
	return string(b), true
}

// NoCloudSeed writes a NoCloud seed's user-data and meta-data (instance id,
// hostname) into dir and returns their paths, for a cidata CD.
func NoCloudSeed(t testing.TB, dir, userData, instanceID, hostname string) []string {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	files := []string{filepath.Join(dir, "user-data"), filepath.Join(dir, "meta-data")}
	meta := fmt.Sprintf("instance-id: %s\nlocal-hostname: %s\n", instanceID, hostname)
	for i, content := range []string{userData, meta} {
		if err := os.WriteFile(files[i], []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return files
}

// FreePort is a loopback TCP port free now.
func FreePort(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// ConsoleTail is the end of the guest's serial console.
func (v *VM) ConsoleTail(n int) string {
	b, _ := os.ReadFile(v.console)
	return tail(b, n)
}

// SSHTarget is user@127.0.0.1:port, as tandem --ssh takes it.
func (v *VM) SSHTarget() string { return fmt.Sprintf("%s@127.0.0.1:%d", v.User, v.SSHPort) }

func (v *VM) sshArgs(script string) []string {
	return []string{"-p", strconv.Itoa(v.SSHPort), "-i", v.ClientKey, "-o", "UserKnownHostsFile=" + v.KnownHosts,
		"-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR",
		v.User + "@127.0.0.1", "sudo sh -c " + shellQuote(script)}
}

// Run runs script as root in the guest; stdin, if not nil, is its input.
func (v *VM) Run(ctx context.Context, script string, stdin []byte) (string, error) {
	cmd := exec.CommandContext(ctx, "ssh", v.sshArgs(script)...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// MustRun is Run that fails the test.
func (v *VM) MustRun(ctx context.Context, script string) string {
	v.t.Helper()
	out, err := v.Run(ctx, script, nil)
	if err != nil {
		v.t.Fatalf("guest: %s: %v\n%s", script, err, out)
	}
	return out
}

// WaitSSH waits until the guest answers SSH with the test's key (the first
// time, its host keys are scanned into KnownHosts: the guest made them at
// first boot) and returns how long that took.
func (v *VM) WaitSSH(ctx context.Context, limit time.Duration) time.Duration {
	v.t.Helper()
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	for {
		if _, err := os.Stat(v.KnownHosts); err != nil {
			scan, _ := exec.CommandContext(ctx, "ssh-keyscan", "-T", "5", "-p", strconv.Itoa(v.SSHPort), "127.0.0.1").Output()
			if bytes.Contains(scan, []byte("ssh-ed25519")) {
				_ = os.WriteFile(v.KnownHosts, scan, 0o600)
			}
		}
		if _, err := os.Stat(v.KnownHosts); err == nil {
			if _, err := v.Run(ctx, "true", nil); err == nil {
				return time.Since(start)
			}
		}
		if out, gone := v.exited(); gone {
			v.t.Fatalf("qemu exited: %s", out)
		}
		// A kernel prints to the console within seconds; a console still
		// empty after 90 s is a QEMU that never ran the guest (seen once in
		// ~40 boots under TCG). Boot it again, once, and say so.
		if fi, err := os.Stat(v.console); !v.restarted && time.Since(start) > 90*time.Second && (err != nil || fi.Size() == 0) {
			v.restarted = true
			v.t.Logf("the guest printed nothing in %s; killing QEMU and booting it again", time.Since(start).Round(time.Second))
			_ = syscall.Kill(-v.qemu.Process.Pid, syscall.SIGKILL)
			v.Boot(v.boot)
		}
		select {
		case <-ctx.Done():
			v.t.Fatalf("the guest did not answer SSH in %s", limit)
		case <-time.After(2 * time.Second):
		}
	}
}

// WaitCloudInit waits for cloud-init's final stage and returns `cloud-init
// status --long` and whether it ended in error.
func (v *VM) WaitCloudInit(ctx context.Context) (string, bool) {
	v.t.Helper()
	out, err := v.Run(ctx, "cloud-init status --long --wait", nil)
	if err != nil {
		if ee, ok := err.(*exec.ExitError); ok && ee.ExitCode() == 1 {
			return out, true // cloud-init 22.4: 1 = error (2 = recoverable is newer)
		}
		v.t.Fatalf("cloud-init status: %v\n%s", err, out)
	}
	return out, false
}

// Reboot reboots the guest and waits for SSH again.
func (v *VM) Reboot(ctx context.Context, limit time.Duration) time.Duration {
	v.t.Helper()
	boot := v.MustRun(ctx, "cat /proc/sys/kernel/random/boot_id")
	_, _ = v.Run(ctx, "systemctl reboot", nil)
	start := time.Now()
	deadline := time.Now().Add(limit)
	for time.Now().Before(deadline) {
		time.Sleep(3 * time.Second)
		if out, err := v.Run(ctx, "cat /proc/sys/kernel/random/boot_id", nil); err == nil && out != boot {
			return time.Since(start)
		}
	}
	v.t.Fatalf("the guest did not come back from a reboot in %s", limit)
	return 0
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }
