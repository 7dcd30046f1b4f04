// Package metrics reads the job container's resource usage from its cgroup
// (v2 or v1) and GPU usage from nvidia-smi when the NVIDIA runtime put it in
// the container.
package metrics

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/tandem-run/tandem/api"
)

// ErrUnavailable means no cgroup data at all could be found.
var ErrUnavailable = errors.New("no cgroup data available")

// Collector reads metrics; the roots are injectable for tests.
type Collector struct {
	ProcRoot   string // "/proc"
	CgroupRoot string // "" = from /proc/self/mounts
	NvidiaSMI  string // "" = look up nvidia-smi on PATH
	Now        func() time.Time
}

type mount struct{ fstype, dir, opts string }

func (c Collector) mounts() ([]mount, error) {
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

func (c Collector) proc() string {
	if c.ProcRoot == "" {
		return "/proc"
	}
	return c.ProcRoot
}

// cgroupPaths maps controller ("" for v2) to the process's cgroup path.
func (c Collector) cgroupPaths() (map[string]string, error) {
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
func (c Collector) resolve(ms []mount, controller, cgPath string) string {
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

func (c Collector) join(dir, cgPath string) string {
	if c.CgroupRoot != "" {
		dir = filepath.Join(c.CgroupRoot, strings.TrimPrefix(dir, "/sys/fs/cgroup"))
	}
	p := filepath.Join(dir, cgPath)
	if _, err := os.Stat(p); err != nil {
		return dir // the namespace root is our cgroup
	}
	return p
}

// Collect returns the current usage.
func (c Collector) Collect(ctx context.Context) (api.MetricsResponse, error) {
	now := time.Now
	if c.Now != nil {
		now = c.Now
	}
	resp := api.MetricsResponse{TimestampMicro: now().UnixMicro(), GPUs: []api.GPUMetrics{}}
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

func (c Collector) v2(dir string, r *api.MetricsResponse) error {
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

func (c Collector) v1(cpuDir, memDir string, r *api.MetricsResponse) error {
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

func (c Collector) gpus(ctx context.Context) []api.GPUMetrics {
	out := []api.GPUMetrics{}
	bin := c.NvidiaSMI
	if bin == "" {
		p, err := exec.LookPath("nvidia-smi")
		if err != nil {
			return out
		}
		bin = p
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	b, err := exec.CommandContext(ctx, bin, "--query-gpu=memory.used,utilization.gpu", "--format=csv,noheader,nounits").Output()
	if err != nil {
		return out
	}
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.Split(l, ",")
		if len(f) != 2 {
			continue
		}
		mib, err1 := strconv.ParseUint(strings.TrimSpace(f[0]), 10, 64)
		util, err2 := strconv.Atoi(strings.TrimSpace(f[1]))
		if err1 != nil || err2 != nil {
			continue
		}
		out = append(out, api.GPUMetrics{GPUMemoryUsageBytes: mib << 20, GPUUtilPercent: util})
	}
	return out
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
