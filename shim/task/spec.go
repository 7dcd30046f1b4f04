package task

// The container spec a task becomes.

import (
	"cmp"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/shim/gpu"
)

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
	cmd = append(cmd, e.cfg.RunnerArgs...)
	binds := []Bind{
		{Source: dir, Target: RunnerDirInContainer},
		{Source: e.cfg.RunnerBinary, Target: RunnerBinaryInContainer, ReadOnly: true},
	}
	env := e.containerEnv(cfg.ID, cfg.NetworkMode)
	if e.cfg.Home != "" {
		// The runner watches the host's free space through it (its own dir
		// is a filesystem of its own, whose free space says nothing of the
		// host's).
		binds = append(binds, Bind{Source: e.hostFSProbe(), Target: HostFSInContainer, ReadOnly: true})
		env = append(env, RunnerHostFSEnv+"="+HostFSInContainer)
	}
	for _, v := range cfg.VolumeMounts {
		binds = append(binds, Bind{Source: filepath.Join(e.cfg.VolumesRoot, v.Name), Target: v.Path})
	}
	for _, m := range cfg.InstanceMounts {
		binds = append(binds, Bind{Source: filepath.Clean(m.InstancePath), Target: m.Path, ReadOnly: m.ReadOnly})
	}
	t.mu.Lock()
	network := t.network
	t.mu.Unlock()
	spec := ContainerSpec{
		Name:        t.name,
		Image:       cfg.ImageName,
		User:        engineUser(cfg.ContainerUser),
		Entrypoint:  []string{RunnerBinaryInContainer},
		Cmd:         cmd,
		Env:         env,
		Labels:      map[string]string{LabelIsTask: "true", LabelTaskID: cfg.ID, LabelShimHome: e.cfg.Home},
		NetworkMode: cmp.Or(network, cfg.NetworkMode),
		Privileged:  cfg.Privileged || e.cfg.Privileged,
		ExposedTCP:  e.runnerPorts(),
		Forwarded:   e.cfg.Forwarder != nil,
		Published:   cfg.Publish,
		Binds:       binds,
		ShmSize:     cfg.ShmSize,
		PidsLimit:   cmp.Or(cfg.PidsLimit, e.cfg.PidsLimit),
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
// CDI), AMD the kfd and render nodes with what ROCm needs, Gaudi the
// habana runtime and its variable, Tenstorrent its device nodes and 1 GiB
// hugepages (gpu.Host.Wire).
func (e *Engine) wireGPUs(spec *ContainerSpec, cfg api.TaskConfig, gpuIDs []string) {
	if len(cfg.GPUDevices) > 0 {
		for _, d := range cfg.GPUDevices {
			spec.Devices = append(spec.Devices, Device{Host: d.PathOnHost, Container: d.PathInContainer, Perms: "rwm"})
		}
		return
	}
	w := gpu.Host{Root: e.cfg.GPUHostRoot, CDI: e.nvidiaCDI()}.Wire(e.cfg.GPUVendor, gpuIDs)
	spec.GPUs = w.Request
	for _, d := range w.Devices {
		spec.Devices = append(spec.Devices, Device{Host: d.Host, Container: d.Container, Perms: "rwm"})
	}
	for _, b := range w.Binds {
		spec.Binds = append(spec.Binds, Bind{Source: b.Host, Target: b.Container})
	}
	if len(w.Env) > 0 {
		// The vendor's variables are the shim's to set: a passed-through
		// value of the same name is dropped, never left to shadow them.
		spec.Env = slices.DeleteFunc(spec.Env, func(kv string) bool {
			return slices.ContainsFunc(w.Env, func(own string) bool { return envName(kv) == envName(own) })
		})
		spec.Env = append(spec.Env, w.Env...)
	}
	if w.Runtime != "" {
		spec.Runtime = w.Runtime
	}
	if w.IpcHost {
		spec.IpcMode = "host"
	}
	spec.CapAdd = append(spec.CapAdd, w.CapAdd...)
	spec.SecurityOpt = append(spec.SecurityOpt, w.SecurityOpt...)
}

// envName is the name of a NAME=value pair.
func envName(kv string) string {
	name, _, _ := strings.Cut(kv, "=")
	return name
}

// withoutDisplay drops the display capability (headless hosts have no
// /dev/nvidia-modeset; dstack issue #4004).
func withoutDisplay(spec ContainerSpec) ContainerSpec {
	spec.GPUs = gpu.WithoutDisplay(spec.GPUs)
	return spec
}

// runnerPorts are the container ports a bridge task's runner serves.
func (e *Engine) runnerPorts() []int { return []int{e.cfg.RunnerHTTPPort, e.cfg.RunnerSSHPort} }

// RunnerTaskIDEnv tells our runner which task it serves (its healthcheck
// says so).
const RunnerTaskIDEnv = "TANDEM_TASK_ID"

// RunnerHostFSEnv tells our runner where, in its container, a path on the
// host's filesystem is (HostFSInContainer).
const (
	RunnerHostFSEnv   = "TANDEM_RUNNER_HOST_FS"
	HostFSInContainer = "/tmp/.tandem-hostfs"
)

// hostFSProbe is the empty directory on the shim home's filesystem bound
// read-only into every container: all a job learns through it is that
// filesystem's size and free space.
func (e *Engine) hostFSProbe() string { return filepath.Join(e.cfg.Home, "runners", ".hostfs") }

// RunnerAPIUIDsEnv tells our runner which local uids its API serves.
const RunnerAPIUIDsEnv = "TANDEM_RUNNER_API_UIDS"

// containerEnv is the shim's environment for every container, and for a
// host-network one the uids its runner's API may serve: its port is on the
// host's loopback, where the shim cannot gate it (a bridge task's ports
// are the shim's forwards).
func (e *Engine) containerEnv(taskID, networkMode string) []string {
	env := append(slices.Clone(e.cfg.Env), RunnerTaskIDEnv+"="+taskID)
	if networkMode == "host" && e.cfg.RunnerAPIUIDs != nil {
		uids := e.cfg.RunnerAPIUIDs()
		parts := make([]string, len(uids))
		for i, u := range uids {
			parts[i] = strconv.FormatUint(uint64(u), 10)
		}
		env = append(env, RunnerAPIUIDsEnv+"="+strings.Join(parts, ","))
	}
	return env
}

// engineUser is the container user as the engine is told it. root is
// given as uid 0: Docker resolves a name in the image's /etc/passwd and
// refuses to start an image that has none (FROM scratch, distroless:
// "unable to find user root"), while uid 0 needs no entry, and where one
// exists it is the same user with the same groups.
func engineUser(u string) string {
	if u == "root" {
		return "0"
	}
	return u
}
