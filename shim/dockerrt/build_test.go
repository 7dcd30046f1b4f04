package dockerrt

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"testing"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/shim/task"
)

var update = flag.Bool("update", false, "rewrite golden files")

func base() task.ContainerSpec {
	return task.ContainerSpec{
		Name: "job-1-44f7cb95", Image: "dstackai/base:cuda-12.1", User: "root",
		Entrypoint:  []string{"/usr/local/bin/dstack-runner"},
		Cmd:         []string{"--log-level", "info", "start", "--temp-dir", "/tmp/runner", "--http-port", "10999", "--ssh-port", "10022", "--http-address", "localhost"},
		Env:         []string{"http_proxy=http://proxy:3128"},
		Labels:      map[string]string{"ai.dstack.shim.is-task": "true", "ai.dstack.shim.task-id": "t1"},
		NetworkMode: "host", ExposedTCP: []int{10999, 10022},
		Binds: []task.Bind{{Source: "/root/.dstack/runners/job-1-44f7cb95", Target: "/tmp/runner"},
			{Source: "/usr/local/bin/dstack-runner", Target: "/usr/local/bin/dstack-runner", ReadOnly: true}},
		ShmSize: 1 << 30, NanoCPUs: 8e9, Memory: 64 << 30, Init: true,
	}
}

// TestBuildGolden pins the Docker create request per vendor.
func TestBuildGolden(t *testing.T) {
	nvidia := base()
	nvidia.GPUs = &task.GPURequest{DeviceIDs: []string{"GPU-1", "GPU-2"}, Capabilities: []string{"gpu", "utility", "compute", "graphics", "video", "display", "compat32"}}
	cdi := base()
	cdi.GPUs = &task.GPURequest{Driver: "cdi", DeviceIDs: []string{"nvidia.com/gpu=GPU-1"}}
	amd := base()
	amd.Devices = []task.Device{{Host: "/dev/kfd", Container: "/dev/kfd", Perms: "rwm"}, {Host: "/dev/dri/renderD128", Container: "/dev/dri/renderD128", Perms: "rwm"}}
	amd.IpcMode, amd.CapAdd, amd.SecurityOpt = "host", []string{"SYS_PTRACE"}, []string{"seccomp=unconfined"}
	bridge := base()
	bridge.NetworkMode = "bridge"
	bridge.MemlockUnlimited = true
	bridge.Devices = []task.Device{{Host: "/dev/infiniband", Container: "/dev/infiniband", Perms: "rwm"}}
	for name, spec := range map[string]task.ContainerSpec{"create_cpu_host": base(), "create_nvidia": nvidia, "create_nvidia_cdi": cdi, "create_amd": amd, "create_bridge_ib": bridge} {
		t.Run(name, func(t *testing.T) {
			cfg, hc := Build(spec)
			got, err := json.MarshalIndent(map[string]any{"Config": cfg, "HostConfig": hc}, "", "  ")
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, '\n')
			path := filepath.Join("testdata", name+".json")
			if *update {
				_ = os.WriteFile(path, got, 0o644)
			}
			want, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("%v (go test ./shim/dockerrt -update)", err)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("create request drifted from %s:\n%s", path, got)
			}
		})
	}
}

// TestBuildPidsLimit: a task's pids limit reaches Docker; none leaves it
// unset (Docker's default: unlimited).
func TestBuildPidsLimit(t *testing.T) {
	_, hc := Build(task.ContainerSpec{Image: "i", PidsLimit: 4096})
	if hc.Resources.PidsLimit == nil || *hc.Resources.PidsLimit != 4096 {
		t.Fatalf("pids limit %v", hc.Resources.PidsLimit)
	}
	if _, hc := Build(task.ContainerSpec{Image: "i"}); hc.Resources.PidsLimit != nil {
		t.Fatalf("unset pids limit became %d", *hc.Resources.PidsLimit)
	}
}

// TestBuildPublished: a bridge task's published ports reach Docker with
// their address and port (an empty host port: Docker's pick) beside the
// runner's, and survive the shim's own forwarding (which drops only the
// runner's bindings); the host network publishes nothing.
func TestBuildPublished(t *testing.T) {
	pub := []api.PublishedPort{{HostIP: "127.0.0.1", HostPort: 8080, ContainerPort: 80}, {ContainerPort: 53, Protocol: "udp"}}
	for _, forwarded := range []bool{false, true} {
		cfg, hc := Build(task.ContainerSpec{Image: "i", NetworkMode: "bridge", ExposedTCP: []int{10999}, Forwarded: forwarded, Published: pub})
		if b := hc.PortBindings["80/tcp"]; len(b) != 1 || b[0].HostIP != "127.0.0.1" || b[0].HostPort != "8080" {
			t.Errorf("forwarded %v: 80/tcp bound %v", forwarded, b)
		}
		if b := hc.PortBindings["53/udp"]; len(b) != 1 || b[0].HostIP != "" || b[0].HostPort != "" {
			t.Errorf("forwarded %v: 53/udp bound %v", forwarded, b)
		}
		if _, runner := hc.PortBindings["10999/tcp"]; runner == forwarded {
			t.Errorf("forwarded %v: the runner's port bound %v", forwarded, runner)
		}
		if _, ok := cfg.ExposedPorts["53/udp"]; !ok {
			t.Errorf("forwarded %v: 53/udp not exposed", forwarded)
		}
	}
	if _, hc := Build(task.ContainerSpec{Image: "i", NetworkMode: "host", ExposedTCP: []int{10999}, Published: pub}); hc.PortBindings != nil {
		t.Errorf("host network bound %v", hc.PortBindings)
	}
}
