package metrics

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/tandem-run/tandem/api"
)

// amdVendorID is the PCI vendor of AMD's GPUs.
const amdVendorID = "0x1002"

// maxAttr bounds one sysfs attribute read (the kernel prints these in a
// page at most; the numbers are a line).
const maxAttr = 64

// amdSysfs reads the amdgpu driver's usage counters (its documented sysfs:
// device/mem_info_vram_used, mem_info_vram_total, gpu_busy_percent) for the
// render nodes mapped into the container, and only those: sysfs shows every
// GPU of the host, /dev/dri only the job's. A node is taken by its device
// number, checked against the drm class's dev attribute, so a name is not
// enough. The job can make nodes in its own /dev, but all it changes then is
// its own metrics, which it could also fake with an amd-smi of its own.
func (c *Collector) amdSysfs() ([]api.GPUMetrics, error) {
	nodes, err := renderNodes(filepath.Join(c.cfg.Root, "dev", "dri"))
	if err != nil {
		return nil, err
	}
	out := []api.GPUMetrics{}
	var errs []error
	for _, n := range nodes {
		g, err := c.amdNode(n)
		if err != nil {
			if len(errs) < 4 { // a line of log, not one per node the job made
				errs = append(errs, err)
			}
			continue
		}
		out = append(out, g)
	}
	if len(out) == 0 {
		if len(errs) == 0 {
			return nil, errors.New("no render node under /dev/dri")
		}
		return nil, errors.Join(errs...)
	}
	return out, nil
}

// maxDevEntries bounds what is read of the container's /dev/dri, which the
// job may fill: the shim maps a render node per GPU and a card node.
const maxDevEntries = 1024

// renderNodes lists the render nodes of dir in the order of their minors,
// at most maxGPUs of them.
func renderNodes(dir string) ([]string, error) {
	f, err := os.Open(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list render nodes: %w", err)
	}
	defer f.Close()
	ents, err := f.ReadDir(maxDevEntries)
	if err != nil && err != io.EOF {
		return nil, fmt.Errorf("list render nodes: %w", err)
	}
	var nodes []string
	for _, e := range ents {
		if validRenderName(e.Name()) {
			nodes = append(nodes, filepath.Join(dir, e.Name()))
		}
	}
	slices.SortFunc(nodes, func(a, b string) int { return renderMinor(a) - renderMinor(b) })
	return nodes[:min(len(nodes), maxGPUs)], nil
}

// renderMinor orders renderD128 before renderD1000 (names are valid).
func renderMinor(p string) int {
	n, _ := strconv.Atoi(strings.TrimPrefix(filepath.Base(p), "renderD"))
	return n
}

func (c *Collector) amdNode(node string) (api.GPUMetrics, error) {
	name := filepath.Base(node)
	fi, err := os.Lstat(node)
	if err != nil {
		return api.GPUMetrics{}, fmt.Errorf("%s: %w", name, err)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if fi.Mode()&os.ModeCharDevice == 0 || !ok {
		return api.GPUMetrics{}, fmt.Errorf("%s: not a character device", name)
	}
	rdev := uint64(st.Rdev) // uint64 on linux, int32 on darwin
	want := fmt.Sprintf("%d:%d", unix.Major(rdev), unix.Minor(rdev))
	dir := filepath.Join(c.cfg.Root, "sys", "class", "drm", name)
	dev, err := readAttr(filepath.Join(dir, "dev"))
	if err != nil {
		return api.GPUMetrics{}, fmt.Errorf("%s: %w", name, err)
	}
	if dev != want {
		return api.GPUMetrics{}, fmt.Errorf("%s: device %s, sysfs says %s", name, want, dev)
	}
	dir = filepath.Join(dir, "device")
	if v, err := readAttr(filepath.Join(dir, "vendor")); err != nil || v != amdVendorID {
		return api.GPUMetrics{}, fmt.Errorf("%s: not an AMD GPU (vendor %q, %v)", name, v, err)
	}
	var vals [3]string
	for i, a := range []string{"mem_info_vram_used", "mem_info_vram_total", "gpu_busy_percent"} {
		if vals[i], err = readAttr(filepath.Join(dir, a)); err != nil {
			return api.GPUMetrics{}, fmt.Errorf("%s: %w", name, err)
		}
	}
	g, err := amdFromSysfs(vals[0], vals[1], vals[2])
	if err != nil {
		return api.GPUMetrics{}, fmt.Errorf("%s: %w", name, err)
	}
	return g, nil
}

func validRenderName(name string) bool {
	d := strings.TrimPrefix(name, "renderD")
	return d != name && d != "" && len(d) <= 6 && strings.TrimLeft(d, "0123456789") == ""
}

// amdFromSysfs reads the three attributes: bytes used, bytes in all, and
// the busy percent.
func amdFromSysfs(used, total, busy string) (api.GPUMetrics, error) {
	u, err := parseDec(used)
	if err != nil {
		return api.GPUMetrics{}, fmt.Errorf("mem_info_vram_used: %w", err)
	}
	t, err := parseDec(total)
	if err != nil {
		return api.GPUMetrics{}, fmt.Errorf("mem_info_vram_total: %w", err)
	}
	if u > t {
		return api.GPUMetrics{}, fmt.Errorf("mem_info_vram_used %d is above mem_info_vram_total %d", u, t)
	}
	p, err := parsePercent(busy)
	if err != nil {
		return api.GPUMetrics{}, fmt.Errorf("gpu_busy_percent: %w", err)
	}
	return api.GPUMetrics{GPUMemoryUsageBytes: u, GPUUtilPercent: p}, nil
}

// readAttr reads one short sysfs attribute: a regular file, opened without
// blocking (a fixture's FIFO cannot hold the answer), at most maxAttr bytes.
func readAttr(p string) (string, error) {
	f, err := os.OpenFile(p, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_NOCTTY, 0)
	if err != nil {
		return "", err
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		return "", fmt.Errorf("%s: not a regular file", p)
	}
	b, err := io.ReadAll(io.LimitReader(f, maxAttr+1))
	if err != nil {
		return "", fmt.Errorf("read %s: %w", p, err)
	}
	if len(b) > maxAttr {
		return "", fmt.Errorf("%s: longer than %d bytes", p, maxAttr)
	}
	return strings.TrimSpace(string(b)), nil
}
