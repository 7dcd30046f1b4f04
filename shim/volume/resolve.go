// Package volume attaches network volumes (AWS EBS, GCP persistent disks) to
// tasks: it finds the block device, makes sure there is a filesystem without
// ever reformatting data, mounts it under the volumes root and unmounts it
// exactly once when the task ends.
package volume

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/ident"
)

// Resolver finds the block device of a volume on this host.
type Resolver interface {
	Resolve(ctx context.Context, v api.VolumeInfo) (string, error)
}

// BlockDevice is one row of `lsblk -o NAME,SERIAL`.
type BlockDevice struct{ Name, Serial string }

// Lsblk lists block devices with their serials.
func Lsblk(ctx context.Context) ([]BlockDevice, error) {
	out, err := exec.CommandContext(ctx, "lsblk", "-dn", "-o", "NAME,SERIAL").Output()
	if err != nil {
		return nil, fmt.Errorf("lsblk: %w", err)
	}
	var devs []BlockDevice
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 2 {
			devs = append(devs, BlockDevice{Name: f[0], Serial: f[1]})
		}
	}
	return devs, nil
}

// AWS resolves EBS volumes: on Nitro the NVMe serial is the volume id
// without its dash; it appears some time after the attach call returns, so
// it is polled. On Xen the attachment's device name is used, or its
// /dev/xvdX twin. A partitioned disk yields its first partition.
type AWS struct {
	List     func(ctx context.Context) ([]BlockDevice, error) // Lsblk in production
	Dev      string                                           // "/dev"
	Wait     time.Duration                                    // 30 s
	Interval time.Duration                                    // 500 ms
}

// Resolve implements Resolver.
func (a AWS) Resolve(ctx context.Context, v api.VolumeInfo) (string, error) {
	want := strings.ReplaceAll(v.VolumeID, "-", "")
	if !strings.HasPrefix(want, "vol") {
		return "", fmt.Errorf("volume id %q is not an EBS volume id", v.VolumeID)
	}
	wait, every := a.Wait, a.Interval
	if wait == 0 {
		wait = 30 * time.Second
	}
	if every == 0 {
		every = 500 * time.Millisecond
	}
	dev := a.Dev
	if dev == "" {
		dev = "/dev"
	}
	if v.DeviceName != "" {
		if err := checkDeviceName(v.DeviceName); err != nil {
			return "", err
		}
	}
	deadline := time.Now().Add(wait)
	for {
		devs, err := a.List(ctx)
		if err != nil {
			return "", err
		}
		nitro := false
		for _, d := range devs {
			if d.Serial == want {
				return firstPartition(ctx, filepath.Join(dev, d.Name))
			}
			nitro = nitro || strings.HasPrefix(d.Name, "nvme")
		}
		// On Nitro every EBS volume is an NVMe device carrying its id as
		// serial: device_name there names nothing reliable (it may even
		// be the root disk), so only the serial counts. device_name is for
		// Xen hosts, where there is no NVMe device at all.
		if v.DeviceName != "" && !nitro {
			for _, cand := range []string{v.DeviceName, strings.Replace(v.DeviceName, "/dev/sd", "/dev/xvd", 1)} {
				if _, err := os.Stat(cand); err == nil {
					return firstPartition(ctx, cand)
				}
			}
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("no block device for EBS volume %s (serial %s, device %q) after %s", v.VolumeID, want, v.DeviceName, wait)
		}
		select {
		case <-ctx.Done():
			return "", ctx.Err()
		case <-time.After(every):
		}
	}
}

// checkDeviceName accepts /dev/<name> paths of letters, digits, '-' and '_'.
func checkDeviceName(name string) error {
	rest, ok := strings.CutPrefix(name, "/dev/")
	if !ok || rest == "" || len(name) > 64 {
		return fmt.Errorf("device_name %q is not a /dev/ path", name)
	}
	for _, c := range rest {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return fmt.Errorf("device_name %q: unexpected character %q", name, c)
		}
	}
	return nil
}

// firstPartition returns dev's first partition when it has any.
func firstPartition(ctx context.Context, dev string) (string, error) {
	out, err := exec.CommandContext(ctx, "lsblk", "-ln", "-o", "NAME", dev).Output()
	if err != nil {
		return "", fmt.Errorf("lsblk %s: %w", dev, err)
	}
	lines := strings.Fields(string(out))
	if len(lines) > 1 {
		return filepath.Join(filepath.Dir(dev), lines[1]), nil
	}
	return dev, nil
}

// GCP resolves persistent disks by their by-id links, first partition
// first.
type GCP struct {
	ByID string // "/dev/disk/by-id"
}

// Resolve implements Resolver.
func (g GCP) Resolve(_ context.Context, v api.VolumeInfo) (string, error) {
	if v.DeviceName == "" {
		return "", fmt.Errorf("GCP volume %s has no device name", v.VolumeID)
	}
	if err := ident.VolumeName(strings.ToLower(v.DeviceName)); err != nil || strings.Contains(v.DeviceName, "..") {
		return "", fmt.Errorf("GCP device name %q is not a disk name", v.DeviceName)
	}
	byID := g.ByID
	if byID == "" {
		byID = "/dev/disk/by-id"
	}
	for _, link := range []string{"google-" + v.DeviceName + "-part1", "google-" + v.DeviceName} {
		target, err := os.Readlink(filepath.Join(byID, link))
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return "", fmt.Errorf("resolve %s: %w", link, err)
		}
		if !filepath.IsAbs(target) {
			target = filepath.Join(byID, target)
		}
		return filepath.Clean(target), nil
	}
	return "", fmt.Errorf("no device for GCP disk %s (google-%s) in %s", v.VolumeID, v.DeviceName, byID)
}
