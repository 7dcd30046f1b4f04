package volume

import (
	"context"
	"crypto/sha256"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/internal/loopdev"
)

// byID makes a fixture /dev/disk/by-id with google-<name> → dev.
func byID(t *testing.T, links map[string]string) string {
	dir := t.TempDir()
	for name, dev := range links {
		if err := os.Symlink(dev, filepath.Join(dir, "google-"+name)); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func manager(t *testing.T, resolvers map[string]Resolver) *Manager {
	return &Manager{Root: t.TempDir(), Resolvers: resolvers, DeviceWait: time.Second, Reconfirm: 50 * time.Millisecond, Log: logging.Discard()}
}

func TestFreshDiskFormattedOnceAndDataKept(t *testing.T) {
	dev := loopdev.New(t, 64, false)
	m := manager(t, map[string]Resolver{"gcp": GCP{ByID: byID(t, map[string]string{"data-disk": dev})}})
	v := api.VolumeInfo{Backend: "gcp", Name: "data", VolumeID: "pd-1", DeviceName: "data-disk", InitFS: true}
	ctx := context.Background()
	if err := m.Mount(ctx, "t1", v); err != nil {
		t.Fatal(err)
	}
	mp := m.Mountpoint("data")
	if fi, _ := os.Stat(mp); fi.Mode().Perm() != 0o777 {
		t.Fatalf("a fresh filesystem's root is world-writable: %v", fi.Mode())
	}
	marker := []byte("results of a long training run\n")
	if err := os.WriteFile(filepath.Join(mp, "marker"), marker, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := m.Unmount("data", "t1"); err != nil {
		t.Fatal(err)
	}
	if err := m.Unmount("data", "t1"); err != nil || mounted(mp) {
		t.Fatalf("unmount twice: %v mounted=%v", err, mounted(mp))
	}
	// init_fs again on a disk with data: mounted as is, never reformatted.
	if err := m.Mount(ctx, "t2", v); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(filepath.Join(mp, "marker"))
	if err != nil || sha256.Sum256(got) != sha256.Sum256(marker) {
		t.Fatalf("data lost: %q %v", got, err)
	}
	// Another task cannot take it, nor unmount it.
	if err := m.Mount(ctx, "t3", v); !errors.Is(err, ErrInUse) {
		t.Fatalf("second user: %v", err)
	}
	if err := m.Unmount("data", "t3"); err != nil || !mounted(mp) {
		t.Fatalf("a non-holder must not unmount: %v mounted=%v", err, mounted(mp))
	}
	_ = m.Unmount("data", "t2")
}

func TestRefusals(t *testing.T) {
	blank := loopdev.New(t, 32, false)
	parted := loopdev.New(t, 32, true)
	m := manager(t, map[string]Resolver{"gcp": GCP{ByID: byID(t, map[string]string{"blank": blank, "whole": parted})}})
	ctx := context.Background()
	tests := []struct {
		v    api.VolumeInfo
		want string
	}{
		{api.VolumeInfo{Backend: "gcp", Name: "b", VolumeID: "pd-b", DeviceName: "blank"}, "has no file system (and init_fs is false)"},
		{api.VolumeInfo{Backend: "gcp", Name: "w", VolumeID: "pd-w", DeviceName: "whole", InitFS: true}, "not a file system (a partition table?); refusing to format it"},
		{api.VolumeInfo{Backend: "azure", Name: "x", VolumeID: "x"}, `unknown backend: "azure"`},
		{api.VolumeInfo{Backend: "gcp", Name: "gone", VolumeID: "pd-gone", DeviceName: "missing"}, "no device for GCP disk pd-gone"},
		{api.VolumeInfo{Backend: "gcp", Name: "../etc", VolumeID: "pd-x", DeviceName: "blank"}, "must start with a letter or digit"},
	}
	for _, tc := range tests {
		err := m.Mount(ctx, "t", tc.v)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %q", tc.v, err, tc.want)
		}
		if tc.v.Name != "../etc" && mounted(m.Mountpoint(tc.v.Name)) {
			t.Errorf("%s left mounted", tc.v.Name)
		}
	}
	if out, _ := exec.Command("blkid", "-p", "-o", "value", "-s", "TYPE", blank).Output(); len(out) != 0 {
		t.Fatal("a refused blank disk must stay blank")
	}
	// A failed claim-holder is released: the name is usable again.
	m.mu.Lock()
	n := len(m.users)
	m.mu.Unlock()
	if n != 0 {
		t.Fatalf("claims left behind: %d", n)
	}
}

// AWS: the NVMe serial finds the disk; a partitioned disk mounts its first
// partition.
func TestAWSSerialAndPartition(t *testing.T) {
	parted := loopdev.New(t, 64, true)
	name := filepath.Base(parted)
	list := func(context.Context) ([]BlockDevice, error) {
		return []BlockDevice{{Name: "nvme0n1", Serial: "vol0other"}, {Name: name, Serial: "vol0abc123"}}, nil
	}
	m := manager(t, map[string]Resolver{"aws": AWS{List: list, Wait: time.Second, Interval: 50 * time.Millisecond}})
	v := api.VolumeInfo{Backend: "aws", Name: "ebs", VolumeID: "vol-0abc123", InitFS: true}
	if err := m.Mount(context.Background(), "t", v); err != nil {
		t.Fatal(err)
	}
	defer m.Unmount("ebs", "t")
	out, _ := exec.Command("findmnt", "-n", "-o", "SOURCE", m.Mountpoint("ebs")).Output()
	if strings.TrimSpace(string(out)) != parted+"p1" {
		t.Fatalf("mounted %q, want the first partition %sp1", out, parted)
	}
	// A volume whose device never appears fails after the wait.
	start := time.Now()
	err := m.Mount(context.Background(), "t", api.VolumeInfo{Backend: "aws", Name: "late", VolumeID: "vol-0never"})
	if err == nil || !strings.Contains(err.Error(), "no block device for EBS volume vol-0never") || time.Since(start) < time.Second {
		t.Fatalf("never appears: %v after %s", err, time.Since(start))
	}
}

func fileSum(t *testing.T, path string) [32]byte {
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b)
}

// TestRandomDataNeverFormatted: a disk full of data that no probe
// recognises (a raw database, an encrypted blob) reads as "no signature" to
// blkid; the zero check refuses it and not one byte changes.
func TestRandomDataNeverFormatted(t *testing.T) {
	dev, img := loopdev.Random(t, 16)
	before := fileSum(t, img)
	list := func(context.Context) ([]BlockDevice, error) { return nil, nil } // a Xen host: no NVMe
	m := manager(t, map[string]Resolver{
		"aws": AWS{List: list, Wait: 200 * time.Millisecond, Interval: 50 * time.Millisecond},
		"gcp": GCP{ByID: byID(t, map[string]string{"raw": dev})},
	})
	for _, v := range []api.VolumeInfo{
		{Backend: "aws", Name: "raw", VolumeID: "vol-0raw", DeviceName: dev, InitFS: true},
		{Backend: "gcp", Name: "raw", VolumeID: "pd-raw", DeviceName: "raw", InitFS: true},
	} {
		err := m.Mount(context.Background(), "t", v)
		if err == nil || !strings.Contains(err.Error(), "has data but no file system we recognise") || !strings.Contains(err.Error(), "refusing to format") {
			t.Fatalf("%s: %v", v.Backend, err)
		}
	}
	_ = exec.Command("sync").Run()
	if fileSum(t, img) != before {
		t.Fatal("the random-data disk changed")
	}
}

// TestDeviceInUseRefused: a device mounted elsewhere (here: by someone
// else, at another path) is neither formatted nor mounted a second time.
func TestDeviceInUseRefused(t *testing.T) {
	dev := loopdev.New(t, 32, false)
	if out, err := exec.Command("mkfs.ext4", "-q", dev).CombinedOutput(); err != nil {
		t.Fatalf("mkfs: %v %s", err, out)
	}
	other := t.TempDir()
	if out, err := exec.Command("mount", dev, other).CombinedOutput(); err != nil {
		t.Fatalf("mount: %v %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("umount", other).Run() })
	m := manager(t, map[string]Resolver{"gcp": GCP{ByID: byID(t, map[string]string{"busy": dev})}})
	err := m.Mount(context.Background(), "t", api.VolumeInfo{Backend: "gcp", Name: "busy", VolumeID: "pd", DeviceName: "busy", InitFS: true})
	if err == nil || !strings.Contains(err.Error(), "mounted at "+other) {
		t.Fatalf("in use: %v", err)
	}
	if mounted(m.Mountpoint("busy")) {
		t.Fatal("mounted a second time")
	}
	// A partition's disk counts too: the whole disk of a mounted partition.
	parted := loopdev.New(t, 32, true)
	if out, err := exec.Command("mkfs.ext4", "-q", parted+"p1").CombinedOutput(); err != nil {
		t.Fatalf("mkfs: %v %s", err, out)
	}
	pmnt := t.TempDir()
	if out, err := exec.Command("mount", parted+"p1", pmnt).CombinedOutput(); err != nil {
		t.Fatalf("mount: %v %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("umount", pmnt).Run() })
	if err := m.checkNotInUse(parted); err == nil || !strings.Contains(err.Error(), "mounted at "+pmnt) {
		t.Fatalf("disk of a mounted partition: %v", err)
	}
}

// TestUnmountLeavesForeignMounts: whatever sits at a volume's mount point
// that this shim did not mount (a tmpfs here) is left mounted.
func TestUnmountLeavesForeignMounts(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mount needs root")
	}
	m := manager(t, nil)
	mp := m.Mountpoint("victim")
	_ = os.MkdirAll(mp, 0o755)
	if out, err := exec.Command("mount", "-t", "tmpfs", "tmpfs", mp).CombinedOutput(); err != nil {
		t.Fatalf("mount: %v %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("umount", "-l", mp).Run() })
	if err := m.Unmount("victim", "t"); err == nil || !strings.Contains(err.Error(), "not a block device") {
		t.Fatalf("unmount of a foreign tmpfs: %v", err)
	}
	if !mounted(mp) {
		t.Fatal("the foreign tmpfs was unmounted")
	}
	if err := m.Unmount("../../victim", "t"); err == nil {
		t.Fatal("a path-like name was accepted")
	}
}

// TestNitroIgnoresDeviceName: on an NVMe host device_name may name any
// disk (the root disk, another volume); only the serial counts there.
func TestNitroIgnoresDeviceName(t *testing.T) {
	dev := loopdev.New(t, 16, false)
	list := func(context.Context) ([]BlockDevice, error) {
		return []BlockDevice{{Name: "nvme0n1", Serial: "vol0root"}}, nil
	}
	m := manager(t, map[string]Resolver{"aws": AWS{List: list, Wait: 200 * time.Millisecond, Interval: 50 * time.Millisecond}})
	err := m.Mount(context.Background(), "t", api.VolumeInfo{Backend: "aws", Name: "x", VolumeID: "vol-0missing", DeviceName: dev, InitFS: true})
	if err == nil || !strings.Contains(err.Error(), "no block device for EBS volume") {
		t.Fatalf("device_name used on a Nitro host: %v", err)
	}
	if out, _ := exec.Command("blkid", "-p", "-o", "value", "-s", "TYPE", dev).Output(); len(out) != 0 {
		t.Fatal("the disk named by device_name was formatted")
	}
	if err := checkDeviceName("/dev/../etc/x"); err == nil {
		t.Fatal("device_name with .. accepted")
	}
}

// mounted asks util-linux, independently of the manager's own mountinfo
// reading, whether dir is a mount point.
func mounted(dir string) bool {
	return exec.Command("mountpoint", "-q", dir).Run() == nil
}
