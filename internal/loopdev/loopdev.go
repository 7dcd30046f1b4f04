// Package loopdev gives tests real block devices: loop devices backed by
// temp files, detached when the test ends. Unit tests (shim/volume) and the
// e2e suite both use it.
package loopdev

import (
	"crypto/rand"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// LoopDevice backs a fresh loop device with a sparse file of sizeMiB; with
// partition set it carries one partition spanning the disk (exposed as
// <dev>p1). It is detached with the test.
func New(t testing.TB, sizeMiB int, partition bool) string {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("loop devices need root (CI runs as root)")
		}
		t.Skip("loop devices need root")
	}
	img := filepath.Join(t.TempDir(), "disk.img")
	if err := exec.Command("truncate", "-s", strconv.Itoa(sizeMiB)+"M", img).Run(); err != nil {
		t.Fatal(err)
	}
	if partition {
		cmd := exec.Command("sfdisk", "-q", img)
		cmd.Stdin = strings.NewReader("label: gpt\n,,L\n")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("sfdisk: %v %s", err, out)
		}
	}
	return attachLoop(t, img, partition)
}

// RandomLoopDevice is a loop device of sizeMiB full of random bytes: data
// with no signature any probe recognises. It also returns the image's path,
// to compare its bytes afterwards.
func Random(t testing.TB, sizeMiB int) (dev, img string) {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("loop devices need root (CI runs as root)")
		}
		t.Skip("loop devices need root")
	}
	img = filepath.Join(t.TempDir(), "random.img")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.CopyN(f, rand.Reader, int64(sizeMiB)<<20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	return attachLoop(t, img, false), img
}

func attachLoop(t testing.TB, img string, partition bool) string {
	t.Helper()
	out, err := exec.Command("losetup", "-f", "--show", "-P", img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	if partition {
		// Some kernels (this sandbox's) do not scan loop partitions: add
		// them explicitly; "already there" is fine.
		_ = exec.Command("partx", "-a", dev).Run()
		if _, err := os.Stat(dev + "p1"); err != nil {
			t.Fatalf("partition %sp1 did not appear: %v", dev, err)
		}
	}
	t.Cleanup(func() {
		_ = exec.Command("umount", "-l", dev).Run()
		_ = exec.Command("losetup", "-d", dev).Run()
	})
	return dev
}
