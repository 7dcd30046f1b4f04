package e2e

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/e2e/testenv"
	"github.com/tandem-run/tandem/internal/loopdev"
	"golang.org/x/sys/unix"
)

// saveTarball is `docker save` of a one-layer image tagged tag whose layer
// is one file of size random bytes (incompressible: it takes its size on
// disk).
func saveTarball(t *testing.T, tag string, size int) []byte {
	t.Helper()
	var layer bytes.Buffer
	lw := tar.NewWriter(&layer)
	blob := make([]byte, size)
	_, _ = rand.Read(blob)
	if err := lw.WriteHeader(&tar.Header{Name: "blob", Mode: 0o644, Size: int64(size), Typeflag: tar.TypeReg}); err != nil {
		t.Fatal(err)
	}
	_, _ = lw.Write(blob)
	_ = lw.Close()
	diffID := fmt.Sprintf("sha256:%x", sha256.Sum256(layer.Bytes()))
	cfg, _ := json.Marshal(map[string]any{"architecture": "amd64", "os": "linux", "config": map[string]any{"Cmd": []string{"/blob"}},
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{diffID}}})
	cfgName := fmt.Sprintf("%x.json", sha256.Sum256(cfg))
	man, _ := json.Marshal([]map[string]any{{"Config": cfgName, "RepoTags": []string{tag}, "Layers": []string{"l/layer.tar"}}})
	var out bytes.Buffer
	w := tar.NewWriter(&out)
	for _, f := range []struct {
		name string
		b    []byte
	}{{cfgName, cfg}, {"l/layer.tar", layer.Bytes()}, {"manifest.json", man}} {
		if err := w.WriteHeader(&tar.Header{Name: f.name, Mode: 0o644, Size: int64(len(f.b)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		_, _ = w.Write(f.b)
	}
	_ = w.Close()
	return out.Bytes()
}

func usedPercent(t *testing.T, path string) float64 {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		t.Fatal(err)
	}
	return float64(st.Blocks-st.Bavail) * 100 / float64(st.Blocks)
}

// A shim's image GC on a Docker whose data root is a small loop-device
// filesystem: past the high threshold it removes the images nothing uses
// until the disk is under the low one, and leaves the one kept with
// --image-gc-keep and the one a (stopped) container uses.
func TestShimImageGCFreesDockersDisk(t *testing.T) {
	testenv.RequireDocker(t)
	dev := loopdev.New(t, 320, false)
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", dev).CombinedOutput(); err != nil {
		t.Fatalf("mkfs: %v %s", err, out)
	}
	root := t.TempDir()
	if out, err := exec.Command("mount", dev, root).CombinedOutput(); err != nil {
		t.Fatalf("mount: %v %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("umount", "-l", root).Run() })
	testenv.UnmountUnder(t, root)
	// The later --data-root wins: Docker's whole store on the small disk.
	d := testenv.StartDockerd(t, nil, 60*time.Second, "--data-root", root)
	docker := func(stdin []byte, args ...string) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, "docker", args...)
		cmd.Env = append(os.Environ(), "DOCKER_HOST="+d.Host)
		cmd.Stdin = bytes.NewReader(stdin)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("docker %s: %v %s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	if out := docker(nil, "info", "--format", "{{.DockerRootDir}}"); strings.TrimSpace(out) != root {
		t.Fatalf("data root %q, want %s", out, root)
	}
	const size = 40 << 20
	before := usedPercent(t, root)
	for _, tag := range []string{"gc/a:1", "gc/b:1", "gc/keep:1", "gc/used:1", "gc/mine:1"} {
		docker(saveTarball(t, tag, size), "load", "-q")
	}
	docker(nil, "create", "--name", "holder", "gc/used:1")
	used := usedPercent(t, root)
	perImage := (used - before) / 5
	// Above high now; reaching low needs both free images gone, and no
	// more can go.
	high := int(used) - 1
	low := int(used - 1.6*perImage)
	if low <= int(before)+1 || perImage < 5 {
		t.Fatalf("disk: %.1f%% before, %.1f%% with the images: too little room for the thresholds", before, used)
	}
	// Loaded images have no RepoDigests: only those the shim's ledger
	// names as its own (as its fast pull records them) may go. gc/mine:1
	// stands for one built or loaded on the host by someone else, which
	// may exist nowhere else: it stays, though the disk stays full.
	ledger := ""
	for _, tag := range []string{"gc/a:1", "gc/b:1", "gc/keep:1", "gc/used:1"} {
		ledger += strings.TrimSpace(docker(nil, "image", "inspect", "--format", "{{.Id}}", tag)) + "\n"
	}
	home := t.TempDir()
	testenv.UnmountUnder(t, home)
	if err := os.WriteFile(filepath.Join(home, "images-loaded"), []byte(ledger), 0o600); err != nil {
		t.Fatal(err)
	}
	h := startShimTB(t, runnerScript(t, "exit 0"), []string{"DOCKER_HOST=" + d.Host, "TANDEM_SHIM_IMAGE_GC=true"},
		"--shim-home", home, "--image-gc-high-threshold", strconv.Itoa(high), "--image-gc-low-threshold", strconv.Itoa(low),
		"--image-gc-keep", "gc/keep:1", "--image-gc-interval", "500ms", "--image-gc-min-age", "0s")
	deadline := time.Now().Add(time.Minute)
	var left []string
	for {
		left = strings.Fields(docker(nil, "images", "--format", "{{.Repository}}:{{.Tag}}"))
		slices.Sort(left)
		if !slices.Contains(left, "gc/a:1") && !slices.Contains(left, "gc/b:1") {
			break
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(h.cmd.Stdout.(*os.File).Name())
			t.Fatalf("images left %v at %.1f%% (high %d%%, low %d%%); shim log:\n%s", left, usedPercent(t, root), high, low, testenv.Tail(b, 40))
		}
		time.Sleep(250 * time.Millisecond)
	}
	if want := []string{"gc/keep:1", "gc/mine:1", "gc/used:1"}; !slices.Equal(left, want) {
		t.Fatalf("images left %v, want %v", left, want)
	}
	if after := usedPercent(t, root); after > float64(low) {
		t.Fatalf("disk at %.1f%% after image GC, low threshold %d%%", after, low)
	}
	// It stays there: nothing more may go.
	time.Sleep(1500 * time.Millisecond)
	if again := strings.Fields(docker(nil, "images", "--format", "{{.Repository}}:{{.Tag}}")); len(again) != 3 {
		t.Fatalf("images left later: %v", again)
	}
	docker(nil, "rm", "holder")
}
