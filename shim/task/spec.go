package task

// The container spec a task becomes.

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"github.com/tandem-run/tandem/api"
)

// nvidiaCapabilities are the driver capabilities a task gets (dstack's).
var nvidiaCapabilities = []string{"gpu", "utility", "compute", "graphics", "video", "display", "compat32"}

func (e *Engine) containerSpec(t *task, dir string, gpuIDs []string) ContainerSpec {
	cfg := t.cfg
	cmd := []string{"--log-level", e.cfg.RunnerLogLevel, "start",
		"--temp-dir", RunnerDirInContainer,
		"--http-port", strconv.Itoa(e.cfg.RunnerHTTPPort),
		"--ssh-port", strconv.Itoa(e.cfg.RunnerSSHPort)}
	if cfg.NetworkMode == "host" {
		cmd = append(cmd, "--http-address", "localhost")
	}
	for _, k := range cfg.ContainerSSHKeys {
		cmd = append(cmd, "--ssh-authorized-key", k)
	}
	if e.cfg.RunnerSSHLogLevel != "" {
		cmd = append(cmd, "--ssh-log-level", e.cfg.RunnerSSHLogLevel)
	}
	binds := []Bind{
		{Source: dir, Target: RunnerDirInContainer},
		{Source: e.cfg.RunnerBinary, Target: RunnerBinaryInContainer, ReadOnly: true},
	}
	for _, v := range cfg.VolumeMounts {
		binds = append(binds, Bind{Source: filepath.Join(e.cfg.VolumesRoot, v.Name), Target: v.Path})
	}
	for _, m := range cfg.InstanceMounts {
		binds = append(binds, Bind{Source: filepath.Clean(m.InstancePath), Target: m.Path})
	}
	spec := ContainerSpec{
		Name:        t.name,
		Image:       cfg.ImageName,
		User:        cfg.ContainerUser,
		Entrypoint:  []string{RunnerBinaryInContainer},
		Cmd:         cmd,
		Env:         slices.Clone(e.cfg.Env),
		Labels:      map[string]string{LabelIsTask: "true", LabelTaskID: cfg.ID, LabelShimHome: e.cfg.Home},
		NetworkMode: cfg.NetworkMode,
		Privileged:  cfg.Privileged || e.cfg.Privileged,
		ExposedTCP:  []int{e.cfg.RunnerHTTPPort, e.cfg.RunnerSSHPort},
		Binds:       binds,
		ShmSize:     cfg.ShmSize,
		NanoCPUs:    int64(cfg.CPU * 1e9),
		Memory:      cfg.Memory,
		Init:        true,
	}
	if len(gpuIDs) > 0 {
		e.wireGPUs(&spec, cfg, gpuIDs)
	}
	if _, err := os.Stat(e.cfg.InfinibandPath); !os.IsNotExist(err) {
		spec.Devices = append(spec.Devices, Device{Host: e.cfg.InfinibandPath, Container: "/dev/infiniband", Perms: "rwm"})
		spec.MemlockUnlimited = true
	}
	return spec
}

// wireGPUs gives the container its GPUs: explicit gpu_devices replace all
// vendor logic; otherwise NVIDIA gets a device request (runtime hook or
// CDI) and AMD the kfd and render nodes with what ROCm needs.
func (e *Engine) wireGPUs(spec *ContainerSpec, cfg api.TaskConfig, gpuIDs []string) {
	if len(cfg.GPUDevices) > 0 {
		for _, d := range cfg.GPUDevices {
			spec.Devices = append(spec.Devices, Device{Host: d.PathOnHost, Container: d.PathInContainer, Perms: "rwm"})
		}
		return
	}
	switch e.cfg.GPUVendor {
	case api.GPUVendorNVIDIA:
		if e.cfg.NvidiaCDI {
			ids := make([]string, 0, len(gpuIDs))
			for _, id := range gpuIDs {
				ids = append(ids, "nvidia.com/gpu="+id)
			}
			spec.GPUs = &GPURequest{Driver: "cdi", DeviceIDs: ids}
			return
		}
		spec.GPUs = &GPURequest{DeviceIDs: slices.Clone(gpuIDs), Capabilities: slices.Clone(nvidiaCapabilities)}
	case api.GPUVendorAMD:
		spec.Devices = append(spec.Devices, Device{Host: "/dev/kfd", Container: "/dev/kfd", Perms: "rwm"})
		for _, id := range gpuIDs {
			spec.Devices = append(spec.Devices, Device{Host: id, Container: id, Perms: "rwm"})
		}
		spec.IpcMode = "host"
		spec.CapAdd = []string{"SYS_PTRACE"}
		spec.SecurityOpt = []string{"seccomp=unconfined"}
	}
}

// withoutDisplay drops the display capability (headless hosts have no
// /dev/nvidia-modeset; dstack issue #4004).
func withoutDisplay(spec ContainerSpec) ContainerSpec {
	if spec.GPUs != nil {
		g := *spec.GPUs
		g.Capabilities = slices.DeleteFunc(slices.Clone(g.Capabilities), func(c string) bool { return c == "display" })
		spec.GPUs = &g
	}
	return spec
}
