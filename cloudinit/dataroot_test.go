package cloudinit

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/tandem-run/tandem/internal/loopdev"
)

// dataRootHost is a fixture host for docker-data-root.sh: a /sys with one
// NVMe disk of the given model, backed by a real loop device (its dev
// number and its I/O counters are the loop's own), a mount point,
// daemon.json and a default data root, the boot disk's state directory,
// cloud-init's instance id, and a systemctl that says Docker is stopped.
type dataRootHost struct {
	t                           *testing.T
	sys, dev, mnt, daemon, root string
	loop                        string
	state, instanceID, optIn    string
	env                         []string // more of the script's settings
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
	disk := filepath.Join(h.sys, "block", "nvme1n1")
	_ = os.WriteFile(filepath.Join(disk, "device", "model"), []byte(model+"                    \n"), 0o644)
	_ = os.WriteFile(filepath.Join(disk, "device", "serial"), []byte("AWS"+strings.ToUpper(filepath.Base(loop))+"SERIAL  \n"), 0o644)
	if loop != "" {
		if err := os.Symlink(loop, filepath.Join(h.dev, "nvme1n1")); err != nil {
			t.Fatal(err)
		}
		real := filepath.Join("/sys/block", filepath.Base(loop))
		for _, f := range []string{"dev", "stat", "inflight"} {
			if err := os.Symlink(filepath.Join(real, f), filepath.Join(disk, f)); err != nil {
				t.Fatal(err)
			}
		}
	}
	h.state = filepath.Join(dir, "var", "lib", "tandem")
	h.instanceID = filepath.Join(dir, "instance-id")
	h.optIn = filepath.Join(dir, "etc", "tandem", "format-disks")
	h.setInstance("i-0123456789abcdef0")
	// systemctl: Docker is not running; nothing else is asked of it.
	_ = os.WriteFile(filepath.Join(dir, "bin", "systemctl"), []byte("#!/bin/sh\necho \"systemctl $*\" >>"+filepath.Join(dir, "systemctl.log")+"\n[ \"$1\" = is-active ] && exit 3\nexit 0\n"), 0o755)
	t.Cleanup(func() { _ = unix.Unmount(h.mnt, unix.MNT_DETACH) })
	return h
}

// setInstance is cloud-init's instance id: a stop and start elsewhere, or
// a new instance from the same boot disk, has another.
func (h *dataRootHost) setInstance(id string) {
	if err := os.WriteFile(h.instanceID, []byte(id+"\n"), 0o644); err != nil {
		h.t.Fatal(err)
	}
}

func (h *dataRootHost) run() string {
	h.t.Helper()
	cmd := exec.Command("bash", "scripts/docker-data-root.sh")
	cmd.Env = append(os.Environ(), "TANDEM_SYS="+h.sys, "TANDEM_DEV="+h.dev, "TANDEM_EPHEMERAL_MOUNT="+h.mnt,
		"TANDEM_DOCKER_DAEMON_JSON="+h.daemon, "TANDEM_DOCKER_DEFAULT_ROOT="+h.root,
		"TANDEM_STATE_DIR="+h.state, "TANDEM_INSTANCE_ID_FILE="+h.instanceID,
		"TANDEM_MACHINE_ID_FILE="+filepath.Join(filepath.Dir(h.sys), "no-machine-id"), "TANDEM_FORMAT_DISKS="+h.optIn,
		"PATH="+filepath.Join(filepath.Dir(h.sys), "bin")+":"+os.Getenv("PATH"))
	cmd.Env = append(cmd.Env, h.env...)
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

// untouched fails the test when the script mounted the disk, set the data
// root or changed a byte of the disk's image.
func (h *dataRootHost) untouched(img string, before [32]byte, out string) {
	h.t.Helper()
	if exec.Command("mountpoint", "-q", h.mnt).Run() == nil {
		h.t.Fatalf("mounted:\n%s", out)
	}
	if h.dataRoot() != "" {
		h.t.Fatalf("data-root set: %q\n%s", h.dataRoot(), out)
	}
	if img != "" && sum(h.t, img) != before {
		h.t.Fatalf("the disk changed:\n%s", out)
	}
}

func label(t *testing.T, dev string) string {
	t.Helper()
	b, _ := exec.Command("blkid", "-p", "-s", "LABEL", "-o", "value", dev).Output()
	return strings.TrimSpace(string(b))
}

// writeAt writes b at off through the loop device, as a program that keeps
// its records on the raw disk does, and syncs it to the image.
func writeAt(t *testing.T, dev string, off int64, b []byte) {
	t.Helper()
	f, err := os.OpenFile(dev, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
}

// A disk whose first and last MiB are zeros and which has no signature
// can still hold data: 8 MiB of records in its middle (a raw-device
// database, a tool writing at an offset). Read in full, it is refused.
func TestDataRootRefusesRecordsInTheMiddle(t *testing.T) {
	loop := loopdev.New(t, 64, false)
	records := make([]byte, 8<<20)
	for i := range records {
		records[i] = byte(i*7 + 1)
	}
	writeAt(t, loop, 24<<20, records)
	img := backingFile(t, loop)
	h := newDataRootHost(t, "Amazon EC2 NVMe Instance Storage", loop)
	before := sum(t, img)
	out := h.run()
	if !strings.Contains(out, "not blank") || !strings.Contains(out, "25165824") {
		t.Fatalf("want a refusal naming the first byte of data (offset 25165824):\n%s", out)
	}
	h.untouched(img, before, out)
}

// A blank disk that another process has open for writing is someone's:
// refused, naming the process, though every byte reads as zero.
func TestDataRootRefusesADiskOpenForWriting(t *testing.T) {
	loop := loopdev.New(t, 64, false)
	img := backingFile(t, loop)
	w, err := os.OpenFile(loop, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	h := newDataRootHost(t, "Amazon EC2 NVMe Instance Storage", loop)
	before := sum(t, img)
	out := h.run()
	if !strings.Contains(out, "open for writing") || !strings.Contains(out, strconv.Itoa(os.Getpid())) {
		t.Fatalf("want a refusal naming pid %d:\n%s", os.Getpid(), out)
	}
	h.untouched(img, before, out)
	// And one that holds it exclusively (as a RAID or a mount does).
	w.Close()
	x, err := os.OpenFile(loop, os.O_RDONLY|unix.O_EXCL, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer x.Close()
	h = newDataRootHost(t, "Amazon EC2 NVMe Instance Storage", loop)
	out = h.run()
	if !strings.Contains(out, "in use") {
		t.Fatalf("want a refusal of a claimed disk:\n%s", out)
	}
	h.untouched(img, before, out)
}

// A disk already seen on this instance that no longer carries our label is
// never formatted, however blank it reads now: refused at an earlier boot
// (its data since wiped), or formatted and then wiped. On another instance
// (a new instance id) the same serial is first seen again.
func TestDataRootRefusesADiskSeenOnAnEarlierBoot(t *testing.T) {
	t.Run("refused before", func(t *testing.T) {
		loop := loopdev.New(t, 64, false)
		writeAt(t, loop, 30<<20, []byte("a record"))
		h := newDataRootHost(t, "Amazon EC2 NVMe Instance Storage", loop)
		if out := h.run(); !strings.Contains(out, "not blank") {
			t.Fatalf("first boot:\n%s", out)
		}
		writeAt(t, loop, 30<<20, make([]byte, 8))
		img := backingFile(t, loop)
		before := sum(t, img)
		out := h.run()
		if !strings.Contains(out, "seen on an earlier boot") || !strings.Contains(out, "not blank") {
			t.Fatalf("want the earlier refusal named:\n%s", out)
		}
		h.untouched(img, before, out)
		// A new instance on the same boot disk: first sight there.
		h.setInstance("i-0fedcba9876543210")
		if out := h.run(); !strings.Contains(out, "formatting") || label(t, loop) != "tandem-ephemeral" {
			t.Fatalf("another instance:\n%s", out)
		}
	})
	t.Run("formatted and wiped", func(t *testing.T) {
		loop := loopdev.New(t, 64, false)
		h := newDataRootHost(t, "Amazon EC2 NVMe Instance Storage", loop)
		if out := h.run(); !strings.Contains(out, "formatting") {
			t.Fatalf("first boot:\n%s", out)
		}
		if err := unix.Unmount(h.mnt, 0); err != nil {
			t.Fatal(err)
		}
		_ = os.Remove(h.daemon)
		// Someone's zeros over our filesystem.
		writeAt(t, loop, 0, make([]byte, 64<<20))
		img := backingFile(t, loop)
		before := sum(t, img)
		out := h.run()
		if !strings.Contains(out, "seen on an earlier boot") || !strings.Contains(out, "no longer carries") {
			t.Fatalf("want a refusal of the wiped disk:\n%s", out)
		}
		h.untouched(img, before, out)
	})
}

// A disk too large to read in full at boot is refused with what to do; the
// operator naming its serial is the opt-in, and then it is formatted.
func TestDataRootLargeDiskNeedsTheOperator(t *testing.T) {
	loop := loopdev.New(t, 64, false)
	h := newDataRootHost(t, "Amazon EC2 NVMe Instance Storage", loop)
	h.env = []string{"TANDEM_BLANK_READ_MAX_MIB=32"}
	img := backingFile(t, loop)
	before := sum(t, img)
	out := h.run()
	if !strings.Contains(out, "too large to read") || !strings.Contains(out, h.optIn) {
		t.Fatalf("want a refusal saying how to opt in:\n%s", out)
	}
	h.untouched(img, before, out)
	serial, _ := os.ReadFile(filepath.Join(h.sys, "block", "nvme1n1", "device", "serial"))
	_ = os.MkdirAll(filepath.Dir(h.optIn), 0o755)
	_ = os.WriteFile(h.optIn, []byte("# disks of mine to format\n"+strings.TrimSpace(string(serial))+"\n"), 0o644)
	// A file anyone may write names nothing.
	_ = os.Chmod(h.optIn, 0o666)
	if out := h.run(); !strings.Contains(out, "ignored") || strings.Contains(out, "formatting") {
		t.Fatalf("a world-writable opt-in was honoured:\n%s", out)
	}
	h.untouched(img, before, out)
	_ = os.Chmod(h.optIn, 0o644)
	out = h.run()
	if !strings.Contains(out, "formatting") || label(t, loop) != "tandem-ephemeral" || h.dataRoot() != filepath.Join(h.mnt, "docker") {
		t.Fatalf("opted in:\n%s", out)
	}
}

func backingFile(t *testing.T, loop string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(loop), "loop", "backing_file"))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// The device node must be the disk sysfs describes: a /dev entry pointing
// at another disk (a blank one beside the instance store) is refused.
func TestDataRootRefusesANodeThatIsAnotherDisk(t *testing.T) {
	store, other := loopdev.New(t, 32, false), loopdev.New(t, 32, false)
	h := newDataRootHost(t, "Amazon EC2 NVMe Instance Storage", store)
	node := filepath.Join(h.dev, "nvme1n1")
	if err := os.Remove(node); err != nil || os.Symlink(other, node) != nil {
		t.Fatal(err)
	}
	img := backingFile(t, other)
	before := sum(t, img)
	out := h.run()
	if !strings.Contains(out, "device number is not the one") {
		t.Fatalf("want a refusal of the wrong node:\n%s", out)
	}
	h.untouched(img, before, out)
}
