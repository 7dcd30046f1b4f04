package metrics

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/toolrun"
)

// vendor is whose accelerators the job's container was given.
type vendor string

const (
	vendorNone        vendor = ""
	vendorNVIDIA      vendor = "nvidia"
	vendorAMD         vendor = "amd"
	vendorGaudi       vendor = "gaudi"
	vendorTenstorrent vendor = "tenstorrent"
)

// wslNvidiaSMI is where WSL2 puts nvidia-smi (not on the image's PATH).
const wslNvidiaSMI = "usr/lib/wsl/lib/nvidia-smi"

// vendorOf reads the device nodes the shim mapped into the container, in
// dstack's order: the nodes only one vendor makes first (an AMD iGPU's
// /dev/kfd beside an NVIDIA card is an NVIDIA host), /dev/accel last
// (Gaudi's, but also other NPUs'). With none of them, nvidia-smi on PATH
// still means NVIDIA, as it did before the other vendors were read.
// Lstat: the container's /dev is the job's to change, and a link it made
// is not a device the shim mapped.
func (c *Collector) vendorOf() vendor {
	has := func(p string) bool {
		_, err := os.Lstat(filepath.Join(c.cfg.Root, p))
		return err == nil
	}
	switch {
	case has("dev/nvidiactl"), has("dev/dxg") && has(wslNvidiaSMI):
		return vendorNVIDIA
	case has("dev/tenstorrent"):
		return vendorTenstorrent
	case has("dev/kfd"):
		return vendorAMD
	case has("dev/accel"):
		return vendorGaudi
	}
	if _, err := c.tool(c.cfg.NvidiaSMI, "nvidia-smi"); err == nil {
		return vendorNVIDIA
	}
	return vendorNone
}

// tool is the configured path, else name on PATH, if a job's user could
// not have put it there (trusted): the runner runs it as root, and a job
// that runs as another user must not get root in its container by writing
// an amd-smi into a directory of PATH it owns.
func (c *Collector) tool(configured, name string) (string, error) {
	bin := configured
	if bin == "" {
		p, err := exec.LookPath(name)
		if err != nil {
			return "", err
		}
		bin = p
	}
	if err := trusted(bin); err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			c.once.warn(c.log, "untrusted-"+filepath.Base(bin), "GPU metrics: a vendor tool is not run", "tool", bin, "err", err)
		}
		return "", err
	}
	return bin, nil
}

// gpus is the usage of the job's GPUs; never an error: a GPU source that
// fails leaves the list empty (or takes the next source) and says so once
// in the log.
func (c *Collector) gpus(ctx context.Context) []api.GPUMetrics {
	return c.flight.do(ctx, func(ctx context.Context) []api.GPUMetrics {
		out := c.readGPUs(ctx)
		if out == nil {
			out = []api.GPUMetrics{}
		}
		return out
	})
}

func (c *Collector) readGPUs(ctx context.Context) []api.GPUMetrics {
	switch v := c.vendorOf(); v {
	case vendorNVIDIA:
		bin, err := c.tool(c.cfg.NvidiaSMI, "nvidia-smi")
		if err != nil && c.cfg.NvidiaSMI == "" {
			bin, err = c.tool(filepath.Join(c.cfg.Root, wslNvidiaSMI), "")
		}
		if err != nil {
			c.once.warn(c.log, "nvidia-smi-missing", "no GPU metrics: nvidia-smi is not in the job's image", "vendor", v)
			return nil
		}
		return c.fromTool(ctx, v, bin, parseNvidiaSMI, "--query-gpu=memory.used,utilization.gpu", "--format=csv,noheader,nounits")
	case vendorAMD:
		if bin, err := c.tool(c.cfg.AMDSMI, "amd-smi"); err == nil {
			if g := c.fromTool(ctx, v, bin, parseAMDSMI, "monitor", "-vu", "--csv"); len(g) > 0 {
				return g
			}
		}
		g, err := c.amdSysfs()
		if err != nil {
			c.once.warn(c.log, "amd-none", "no GPU metrics: no usable amd-smi in the job's image and no amdgpu sysfs for its render nodes", "vendor", v, "err", err)
			return nil
		}
		return g
	case vendorGaudi:
		bin, err := c.tool(c.cfg.HLSMI, "hl-smi")
		if err != nil {
			// The habanalabs driver's sysfs (Documentation/ABI/testing/
			// sysfs-driver-habanalabs) has versions, clocks, power and
			// status, but neither memory in use nor utilisation.
			c.once.warn(c.log, "hl-smi-missing", "no GPU metrics: hl-smi is not in the job's image and the habanalabs driver's sysfs has no usage counters", "vendor", v)
			return nil
		}
		return c.fromTool(ctx, v, bin, parseHLSMI, "--query-aip=memory.used,memory.total,utilization.aip", "--format=csv,noheader,nounits")
	case vendorTenstorrent:
		c.once.warn(c.log, "tenstorrent", "no GPU metrics: the runner reads none for Tenstorrent cards, as dstack's does not", "vendor", v)
		return nil
	}
	return nil
}

// fromTool runs a vendor tool and parses what it printed; a failure is
// logged once per tool and gives no GPUs.
func (c *Collector) fromTool(ctx context.Context, v vendor, bin string, parse func([]byte) ([]api.GPUMetrics, error), args ...string) []api.GPUMetrics {
	b, err := runTool(ctx, c.cfg.ToolTimeout, c.cfg.ToolOutput, bin, args...)
	if err == nil {
		var g []api.GPUMetrics
		if g, err = parse(b); err == nil {
			return g
		}
	}
	key := string(v) + "-tool"
	if errors.Is(err, toolrun.ErrTimeout) || errors.Is(err, toolrun.ErrOutput) {
		key = string(v) + "-tool-bound"
	}
	c.once.warn(c.log, key, "GPU metrics: the vendor tool gave no usable answer", "vendor", v, "tool", bin, "err", err)
	return nil
}
