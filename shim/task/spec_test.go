package task

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/tandem-run/tandem/api"
)

func TestContainerSpec(t *testing.T) {
	ib := filepath.Join(t.TempDir(), "infiniband")
	tests := []struct {
		name      string
		engine    func(*Config)
		cfg       api.TaskConfig
		gpus      []string
		check     func(t *testing.T, s ContainerSpec)
		makeIBDir bool
	}{
		{name: "host mode binds the runner API to localhost; keys are separate argv",
			engine: func(c *Config) { c.RunnerSSHLogLevel = "DEBUG" },
			cfg:    api.TaskConfig{NetworkMode: "host", ContainerSSHKeys: []string{"ssh-ed25519 AAAA it's 'quoted'", "ssh-rsa BBBB"}},
			check: func(t *testing.T, s ContainerSpec) {
				want := []string{"--log-level", "info", "start", "--temp-dir", "/tmp/runner", "--http-port", "10999", "--ssh-port", "10022",
					"--http-address", "localhost", "--ssh-authorized-key", "ssh-ed25519 AAAA it's 'quoted'", "--ssh-authorized-key", "ssh-rsa BBBB",
					"--ssh-log-level", "DEBUG"}
				if !slices.Equal(s.Cmd, want) || !slices.Equal(s.Entrypoint, []string{"/usr/local/bin/dstack-runner"}) || !s.Init {
					t.Fatalf("cmd %q", s.Cmd)
				}
			}},
		{name: "bridge mode listens on all interfaces",
			cfg: api.TaskConfig{NetworkMode: "bridge"},
			check: func(t *testing.T, s ContainerSpec) {
				if slices.Contains(s.Cmd, "--http-address") || !slices.Equal(s.ExposedTCP, []int{10999, 10022}) {
					t.Fatalf("cmd %q ports %v", s.Cmd, s.ExposedTCP)
				}
			}},
		{name: "shim --privileged ORs with the task's flag",
			engine: func(c *Config) { c.Privileged = true },
			cfg:    api.TaskConfig{},
			check: func(t *testing.T, s ContainerSpec) {
				if !s.Privileged {
					t.Fatal("not privileged")
				}
			}},
		{name: "gpu_devices only apply to a task holding GPUs",
			cfg:  api.TaskConfig{GPUDevices: []api.GPUDevice{{PathOnHost: "/dev/nvidia0", PathInContainer: "/dev/nvidia0"}}},
			gpus: nil,
			check: func(t *testing.T, s ContainerSpec) {
				if len(s.Devices) != 0 {
					t.Fatalf("devices %v", s.Devices)
				}
			}},
		{name: "gpu_devices replace vendor wiring",
			cfg:  api.TaskConfig{GPUDevices: []api.GPUDevice{{PathOnHost: "/dev/nvidia0", PathInContainer: "/dev/gpu0"}}},
			gpus: []string{"GPU-1"},
			check: func(t *testing.T, s ContainerSpec) {
				if len(s.Devices) != 1 || s.Devices[0] != (Device{Host: "/dev/nvidia0", Container: "/dev/gpu0", Perms: "rwm"}) {
					t.Fatalf("devices %v", s.Devices)
				}
			}},
		{name: "infiniband passes through with unlimited memlock",
			makeIBDir: true,
			check: func(t *testing.T, s ContainerSpec) {
				if !s.MemlockUnlimited || len(s.Devices) != 1 || s.Devices[0].Container != "/dev/infiniband" {
					t.Fatalf("ib: %+v", s)
				}
			}},
		{name: "mounts, limits, env and labels",
			engine: func(c *Config) { c.Env = []string{"http_proxy=x", "PJRT_DEVICE=TPU"} },
			cfg: api.TaskConfig{ID: "id1", CPU: 0.5, Memory: 1 << 30, ShmSize: 1 << 28,
				VolumeMounts:   []api.VolumeMountPoint{{Name: "data", Path: "/data"}},
				InstanceMounts: []api.InstanceMountPoint{{InstancePath: "/srv/cache/", Path: "/cache"}}},
			check: func(t *testing.T, s ContainerSpec) {
				if s.NanoCPUs != 500_000_000 || s.Memory != 1<<30 || s.ShmSize != 1<<28 {
					t.Fatalf("limits %+v", s)
				}
				targets := []string{}
				for _, b := range s.Binds {
					targets = append(targets, b.Source+"->"+b.Target)
				}
				got := strings.Join(targets, " ")
				for _, want := range []string{"/mnt/disks/dstack-volumes/data->/data", "/srv/cache->/cache", "->/tmp/runner", "/runners/.hostfs->/tmp/.tandem-hostfs"} {
					if !strings.Contains(got, want) {
						t.Fatalf("binds %s missing %s", got, want)
					}
				}
				if !slices.Equal(s.Env, []string{"http_proxy=x", "PJRT_DEVICE=TPU", "TANDEM_TASK_ID=id1", "TANDEM_RUNNER_HOST_FS=/tmp/.tandem-hostfs"}) || s.Labels[LabelTaskID] != "id1" || s.Labels[LabelIsTask] != "true" {
					t.Fatalf("env %v labels %v", s.Env, s.Labels)
				}
			}},
		{name: "a host-network runner is told the uids its API serves",
			engine: func(c *Config) { c.RunnerAPIUIDs = func() []uint32 { return []uint32{0, 1000} } },
			cfg:    api.TaskConfig{ID: "id2", NetworkMode: "host"},
			check: func(t *testing.T, s ContainerSpec) {
				if !slices.Equal(s.Env, []string{"TANDEM_TASK_ID=id2", "TANDEM_RUNNER_API_UIDS=0,1000", "TANDEM_RUNNER_HOST_FS=/tmp/.tandem-hostfs"}) {
					t.Fatalf("env %v", s.Env)
				}
			}},
		{name: "a bridge runner is not (the shim's forwards gate its ports), and Docker publishes nothing",
			engine: func(c *Config) {
				c.RunnerAPIUIDs = func() []uint32 { return []uint32{0} }
				c.Forwarder = nopForwarder{}
			},
			cfg: api.TaskConfig{ID: "id3", NetworkMode: "bridge"},
			check: func(t *testing.T, s ContainerSpec) {
				if !slices.Equal(s.Env, []string{"TANDEM_TASK_ID=id3", "TANDEM_RUNNER_HOST_FS=/tmp/.tandem-hostfs"}) || !s.Forwarded {
					t.Fatalf("env %v forwarded %v", s.Env, s.Forwarded)
				}
			}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e, _ := newEngine(t, newStepRuntime())
			e.cfg.InfinibandPath = ib
			_ = os.RemoveAll(ib)
			if tc.makeIBDir {
				_ = os.Mkdir(ib, 0o755)
			}
			if tc.engine != nil {
				tc.engine(&e.cfg)
			}
			cfg := normalize(tc.cfg)
			tk := &task{cfg: cfg, name: ContainerName("n", cfg.ID)}
			tc.check(t, e.containerSpec(tk, "/home/runners/x", tc.gpus))
		})
	}
}

// nopForwarder forwards nothing.
type nopForwarder struct{}

func (nopForwarder) Open(string, string, []int, []api.PortMapping) ([]api.PortMapping, error) {
	return nil, nil
}
func (nopForwarder) Close(string) {}

func TestDefaultPidsLimit(t *testing.T) {
	for pidMax, want := range map[int64]int64{32768: 4096, 4194304: 32768, 8192: 2048, 131072: 16384} {
		if got := DefaultPidsLimit(pidMax); got != want {
			t.Errorf("DefaultPidsLimit(%d) = %d, want %d", pidMax, got, want)
		}
	}
}
