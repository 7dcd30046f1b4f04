package cloudinit

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/tandem-run/tandem/internal/loopdev"
)

// dataRootHost is a fixture host for docker-data-root.sh: a /sys with one
// NVMe disk of the given model, backed by a real loop device, a mount
// point, daemon.json and a default data root, and a systemctl that says
// Docker is stopped.
type dataRootHost struct {
	t                           *testing.T
	sys, dev, mnt, daemon, root string
	loop                        string
}

func newDataRootHost(t *testing.T, model, loop string) *dataRootHost {
	t.Helper()
	dir := t.TempDir()
	h := &dataRootHost{t: t, sys: filepath.Join(dir, "sys"), dev: filepath.Join(dir, "dev"), mnt: filepath.Join(dir, "mnt", "ephemeral"),
		daemon: filepath.Join(dir, "etc", "docker", "daemon.json"), root: filepath.Join(dir, "var", "lib", "docker"), loop: loop}
	for _, d := range []string{filepath.Join(h.sys, "block", "nvme1n1", "device"), h.dev, filepath.Join(dir, "bin")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	_ = os.WriteFile(filepath.Join(h.sys, "block", "nvme1n1", "device", "model"), []byte(model+"                    \n"), 0o644)
	if loop != "" {
		if err := os.Symlink(loop, filepath.Join(h.dev, "nvme1n1")); err != nil {
			t.Fatal(err)
		}
	}
	// systemctl: Docker is not running; nothing else is asked of it.
	_ = os.WriteFile(filepath.Join(dir, "bin", "systemctl"), []byte("#!/bin/sh\necho \"systemctl $*\" >>"+filepath.Join(dir, "systemctl.log")+"\n[ \"$1\" = is-active ] && exit 3\nexit 0\n"), 0o755)
	t.Cleanup(func() { _ = unix.Unmount(h.mnt, unix.MNT_DETACH) })
	return h
}

func (h *dataRootHost) run() string {
	h.t.Helper()
	cmd := exec.Command("bash", "scripts/docker-data-root.sh")
	cmd.Env = append(os.Environ(), "TANDEM_SYS="+h.sys, "TANDEM_DEV="+h.dev, "TANDEM_EPHEMERAL_MOUNT="+h.mnt,
		"TANDEM_DOCKER_DAEMON_JSON="+h.daemon, "TANDEM_DOCKER_DEFAULT_ROOT="+h.root,
		"PATH="+filepath.Join(filepath.Dir(h.sys), "bin")+":"+os.Getenv("PATH"))
	out, err := cmd.CombinedOutput()
	if err != nil {
		h.t.Fatalf("docker-data-root.sh: %v\n%s", err, out)
	}
	return string(out)
}

func (h *dataRootHost) dataRoot() string {
	b, err := os.ReadFile(h.daemon)
	if err != nil {
		return ""
	}
	var cfg map[string]any
	if err := json.Unmarshal(b, &cfg); err != nil {
		h.t.Fatalf("daemon.json: %v %s", err, b)
	}
	s, _ := cfg["data-root"].(string)
	return s
}

func sum(t *testing.T, path string) [32]byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return [32]byte(h.Sum(nil))
}

// A blank instance store is formatted and mounted, Docker's data root is
// set there with the rest of daemon.json kept, and images baked on the
// boot disk are copied over; after a reboot it is mounted again, never
// formatted again.
func TestDataRootOnBlankInstanceStore(t *testing.T) {
	h := newDataRootHost(t, "Amazon EC2 NVMe Instance Storage", loopdev.New(t, 64, false))
	_ = os.MkdirAll(filepath.Dir(h.daemon), 0o755)
	_ = os.WriteFile(h.daemon, []byte(`{"live-restore": true}`), 0o644)
	_ = os.MkdirAll(filepath.Join(h.root, "image"), 0o755)
	_ = os.WriteFile(filepath.Join(h.root, "image", "baked"), []byte("prepulled"), 0o644)
	out := h.run()
	if got := h.dataRoot(); got != filepath.Join(h.mnt, "docker") {
		t.Fatalf("data-root %q\n%s", got, out)
	}
	if b, _ := os.ReadFile(h.daemon); !bytes.Contains(b, []byte(`"live-restore": true`)) {
		t.Fatalf("daemon.json lost its settings: %s", b)
	}
	if b, err := os.ReadFile(filepath.Join(h.mnt, "docker", "image", "baked")); err != nil || string(b) != "prepulled" {
		t.Fatalf("baked images not copied: %q %v", b, err)
	}
	if label, _ := exec.Command("blkid", "-p", "-s", "LABEL", "-o", "value", h.loop).Output(); strings.TrimSpace(string(label)) != "tandem-ephemeral" {
		t.Fatalf("label %q", label)
	}
	// Reboot: unmounted, the disk keeps its data.
	_ = os.WriteFile(filepath.Join(h.mnt, "docker", "layer"), []byte("kept"), 0o644)
	if err := unix.Unmount(h.mnt, 0); err != nil {
		t.Fatal(err)
	}
	out = h.run()
	if b, err := os.ReadFile(filepath.Join(h.mnt, "docker", "layer")); err != nil || string(b) != "kept" {
		t.Fatalf("after a reboot: %q %v\n%s", b, err, out)
	}
	if strings.Contains(out, "formatting") {
		t.Fatalf("formatted again:\n%s", out)
	}
	// And again, mounted: nothing to do.
	if out := h.run(); strings.Contains(out, "formatting") || strings.Contains(out, "copying") {
		t.Fatalf("third run:\n%s", out)
	}
}

// Disks that hold data, a network disk and an operator's own data root are
// never touched: no format, no mount, daemon.json as it was.
func TestDataRootNeverTouchesData(t *testing.T) {
	randomDev, randomImg := loopdev.Random(t, 16)
	ext4Dev := loopdev.New(t, 32, false)
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-L", "scratch", ext4Dev).CombinedOutput(); err != nil {
		t.Fatalf("mkfs: %v %s", err, out)
	}
	blank := loopdev.New(t, 32, false)
	// A disk whose last MiB holds data (a backup header), the rest zeros.
	tailed := loopdev.New(t, 32, false)
	if f, err := os.OpenFile(tailed, os.O_WRONLY, 0); err == nil {
		_, _ = f.WriteAt([]byte("data at the end"), 32<<20-4096)
		f.Close()
	}
	cases := []struct {
		name, model, loop, daemon, want string
	}{
		{"random bytes", "Amazon EC2 NVMe Instance Storage", randomDev, "", "not blank"},
		{"a filesystem it did not make", "nvme_card", ext4Dev, "", "did not make"},
		{"data in the last MiB", "Microsoft NVMe Direct Disk", tailed, "", "not blank"},
		{"a network disk", "Amazon Elastic Block Store", blank, "", "no instance-store NVMe"},
		{"google persistent disk", "nvme_card-pd", blank, "", "no instance-store NVMe"},
		{"the operator's data root", "Amazon EC2 NVMe Instance Storage", blank, `{"data-root": "/data/docker"}`, "left as the operator chose"},
	}
	before := sum(t, randomImg)
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newDataRootHost(t, c.model, c.loop)
			if c.daemon != "" {
				_ = os.MkdirAll(filepath.Dir(h.daemon), 0o755)
				_ = os.WriteFile(h.daemon, []byte(c.daemon), 0o644)
			}
			out := h.run()
			if !strings.Contains(out, c.want) {
				t.Fatalf("want %q in:\n%s", c.want, out)
			}
			if exec.Command("mountpoint", "-q", h.mnt).Run() == nil {
				t.Fatal("mounted")
			}
			if c.daemon == "" && h.dataRoot() != "" {
				t.Fatalf("data-root set: %q", h.dataRoot())
			}
			if c.daemon != "" && h.dataRoot() != "/data/docker" {
				t.Fatalf("the operator's data-root changed: %q", h.dataRoot())
			}
		})
	}
	if sum(t, randomImg) != before {
		t.Fatal("the disk with random bytes changed")
	}
	if label, _ := exec.Command("blkid", "-p", "-s", "LABEL", "-o", "value", ext4Dev).Output(); strings.TrimSpace(string(label)) != "scratch" {
		t.Fatalf("the ext4 disk's label is now %q", label)
	}
}
