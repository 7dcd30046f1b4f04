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
	"github.com/tandem-run/tandem/e2e/testenv"
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
	dev := testenv.LoopDevice(t, 64, false)
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
	blank := testenv.LoopDevice(t, 32, false)
	parted := testenv.LoopDevice(t, 32, true)
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
		{api.VolumeInfo{Backend: "gcp", Name: "../etc", VolumeID: "pd-x", DeviceName: "blank"}, "not a single path component"},
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
	parted := testenv.LoopDevice(t, 64, true)
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
