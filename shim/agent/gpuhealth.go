package agent

// Whether the host can give its GPUs: the monitor behind the GPU part of
// /api/instance/health and the exclusions in the GPU lock table.

import (
	"context"
	"path/filepath"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/shim/gpu"
)

// startGPUHealth checks the host's GPUs once before the API serves (the
// first health answer already says what is wrong: no Docker call, which
// could hang, in it), then with Docker's answer in the background every
// gpu.HealthInterval. Its stop ends the checks and waits for them.
func (a *agent) startGPUHealth(ctx context.Context) *gpu.Monitor {
	mon := &gpu.Monitor{DevRoot: filepath.Join(a.cfg.HostRoot, "dev"), SysRoot: filepath.Join(a.cfg.HostRoot, "sys"),
		GPUs: a.gpus, Locks: a.locks, Access: a.gpuAccess, Log: a.log}
	ctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	if a.nvml != nil {
		mon.NVML = a.nvml
		if a.vendor == api.GPUVendorNVIDIA {
			mon.XIDs = a.nvml.WatchXIDs(ctx)
		}
	}
	mon.CheckHost()
	done := make(chan struct{})
	go func() {
		defer close(done)
		mon.Check(ctx)
		t := time.NewTicker(gpu.HealthInterval)
		defer t.Stop()
		mon.Run(ctx, t.C)
	}()
	a.OnStop(func() {
		cancel()
		<-done
	})
	return mon
}

// gpuAccess is how Docker hands NVIDIA GPUs to containers, as the task
// engine decides it (dockerrt's GPUMode, task.Engine's nvidiaCDI): the
// nvidia runtime when registered, CDI when configured so or when Docker
// reads CDI specs without that runtime.
func (a *agent) gpuAccess(ctx context.Context) (gpu.Access, error) {
	mode, dirs, err := a.rt.GPUAccess(ctx)
	if err != nil {
		return gpu.Access{}, err
	}
	return gpu.Access{Runtime: mode == "hook", CDI: a.tcfg.NvidiaCDI || mode == "cdi", CDIDirs: dirs}, nil
}
