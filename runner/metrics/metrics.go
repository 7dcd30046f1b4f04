// Package metrics reads the job container's resource usage: CPU and memory
// from its cgroup (v2 or v1), and the usage of the GPUs mapped into it from
// the vendor's tool in the image (nvidia-smi, amd-smi, hl-smi) or, for AMD,
// from the amdgpu driver's sysfs. What it reports is dstack's /api/metrics.
package metrics

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/tandem-run/tandem/api"
)

// ErrUnavailable means no cgroup data at all could be found.
var ErrUnavailable = errors.New("no cgroup data available")

// Config says where the collector reads; every root is injectable so the
// hardware code runs against fixture trees.
type Config struct {
	ProcRoot   string // "/proc"
	CgroupRoot string // "" = from /proc/self/mounts
	// Root is where /dev and /sys are read to find the job's GPUs and,
	// for AMD without amd-smi, their usage ("/" in a job's container).
	Root string
	// The vendor tools; "" = looked up on PATH (the image's).
	NvidiaSMI, AMDSMI, HLSMI string
	// ToolTimeout bounds one run of a vendor tool, ToolOutput what it may
	// print; past either the run is killed (its process group) and the
	// answer has no GPU usage from it.
	ToolTimeout time.Duration
	ToolOutput  int
}

// Defaults are the collector's settings in a job's container.
func Defaults() Config {
	return Config{ProcRoot: "/proc", Root: "/", ToolTimeout: defaultToolTimeout, ToolOutput: defaultToolOutput}
}

// Collector reads metrics. Its GPU part runs at most one vendor tool at a
// time: concurrent requests share the run in flight.
type Collector struct {
	cfg    Config
	log    *slog.Logger
	now    func() time.Time
	flight flight
	once   logOnce
}

// New returns a collector; zero fields of cfg take Defaults'. now may be nil
// (time.Now).
func New(cfg Config, log *slog.Logger, now func() time.Time) *Collector {
	d := Defaults()
	if cfg.ProcRoot == "" {
		cfg.ProcRoot = d.ProcRoot
	}
	if cfg.Root == "" {
		cfg.Root = d.Root
	}
	if cfg.ToolTimeout <= 0 {
		cfg.ToolTimeout = d.ToolTimeout
	}
	if cfg.ToolOutput <= 0 {
		cfg.ToolOutput = d.ToolOutput
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if now == nil {
		now = time.Now
	}
	return &Collector{cfg: cfg, log: log, now: now}
}

type mount struct{ fstype, dir, opts string }

func (c *Collector) mounts() ([]mount, error) {
	b, err := os.ReadFile(filepath.Join(c.proc(), "self", "mounts"))
	if err != nil {
		return nil, err
	}
	var out []mount
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) >= 4 {
			out = append(out, mount{fstype: f[2], dir: f[1], opts: f[3]})
		}
	}
	return out, nil
}

func (c *Collector) proc() string { return c.cfg.ProcRoot }

// cgroupPaths maps controller ("" for v2) to the process's cgroup path.
func (c *Collector) cgroupPaths() (map[string]string, error) {
	b, err := os.ReadFile(filepath.Join(c.proc(), "self", "cgroup"))
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		parts := strings.SplitN(l, ":", 3)
		if len(parts) != 3 {
			continue
		}
		if parts[0] == "0" && parts[1] == "" {
			out[""] = parts[2]
			continue
		}
		for _, ctl := range strings.Split(parts[1], ",") {
			out[ctl] = parts[2]
		}
	}
	return out, nil
}

// resolve finds the directory of a controller ("" = v2) and the cgroup path
// inside it. In a container with a private cgroup namespace the path is "/".
func (c *Collector) resolve(ms []mount, controller, cgPath string) string {
	for _, m := range ms {
		if controller == "" && m.fstype == "cgroup2" {
			return c.join(m.dir, cgPath)
		}
		if controller != "" && m.fstype == "cgroup" {
			for _, o := range strings.Split(m.opts, ",") {
				if o == controller {
					return c.join(m.dir, cgPath)
				}
			}
		}
	}
	return ""
}

func (c *Collector) join(dir, cgPath string) string {
	if c.cfg.CgroupRoot != "" {
		dir = filepath.Join(c.cfg.CgroupRoot, strings.TrimPrefix(dir, "/sys/fs/cgroup"))
	}
	p := filepath.Join(dir, cgPath)
	if _, err := os.Stat(p); err != nil {
		return dir // the namespace root is our cgroup
	}
	return p
}

// Collect returns the current usage.
func (c *Collector) Collect(ctx context.Context) (api.MetricsResponse, error) {
	resp := api.MetricsResponse{TimestampMicro: c.now().UnixMicro(), GPUs: []api.GPUMetrics{}}
	ms, err := c.mounts()
	if err != nil {
		return resp, ErrUnavailable
	}
	paths, err := c.cgroupPaths()
	if err != nil {
		return resp, ErrUnavailable
	}
	if p, ok := paths[""]; ok {
		if dir := c.resolve(ms, "", p); dir != "" {
			if err := c.v2(dir, &resp); err != nil {
				return resp, err
			}
			resp.GPUs = c.gpus(ctx)
			return resp, nil
		}
	}
	cpuDir := c.resolve(ms, "cpuacct", paths["cpuacct"])
	memDir := c.resolve(ms, "memory", paths["memory"])
	if cpuDir == "" && memDir == "" {
		return resp, ErrUnavailable
	}
	if err := c.v1(cpuDir, memDir, &resp); err != nil {
		return resp, err
	}
	resp.GPUs = c.gpus(ctx)
	return resp, nil
}

func (c *Collector) v2(dir string, r *api.MetricsResponse) error {
	stat, err := readKV(filepath.Join(dir, "cpu.stat"))
	if err != nil {
		return err
	}
	r.CPUUsageMicro = stat["usage_usec"]
	cur, err := readUint(filepath.Join(dir, "memory.current"))
	if err != nil {
		return err
	}
	mstat, err := readKV(filepath.Join(dir, "memory.stat"))
	if err != nil {
		return err
	}
	r.MemoryUsageBytes = cur
	r.MemoryWorkingSetBytes = sub(cur, mstat["inactive_file"])
	return nil
}

func (c *Collector) v1(cpuDir, memDir string, r *api.MetricsResponse) error {
	if cpuDir != "" {
		ns, err := readUint(filepath.Join(cpuDir, "cpuacct.usage"))
		if err != nil {
			return err
		}
		r.CPUUsageMicro = ns / 1000
	}
	if memDir != "" {
		cur, err := readUint(filepath.Join(memDir, "memory.usage_in_bytes"))
		if err != nil {
			return err
		}
		mstat, err := readKV(filepath.Join(memDir, "memory.stat"))
		if err != nil {
			return err
		}
		inactive, ok := mstat["total_inactive_file"]
		if !ok {
			inactive = mstat["inactive_file"]
		}
		r.MemoryUsageBytes = cur
		r.MemoryWorkingSetBytes = sub(cur, inactive)
	}
	return nil
}

func sub(a, b uint64) uint64 {
	if b > a {
		return 0
	}
	return a - b
}

func readUint(p string) (uint64, error) {
	b, err := os.ReadFile(p)
	if err != nil {
		return 0, fmt.Errorf("read %s: %w", p, err)
	}
	s := strings.TrimSpace(string(b))
	if s == "max" {
		return 0, nil
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("parse %s: %w", p, err)
	}
	return n, nil
}

func readKV(p string) (map[string]uint64, error) {
	b, err := os.ReadFile(p)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", p, err)
	}
	out := map[string]uint64{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 2 {
			if n, err := strconv.ParseUint(f[1], 10, 64); err == nil {
				out[f[0]] = n
			}
		}
	}
	return out, nil
}
