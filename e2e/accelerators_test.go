package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/client"
	"golang.org/x/sys/unix"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/e2e/testenv"
	"github.com/tandem-run/tandem/internal/gpufixture"
	"github.com/tandem-run/tandem/shim/dockerrt"
)

// hostInfoOf waits for the shim's host_info.json (written once Docker
// answered) and reads it.
func hostInfoOf(t *testing.T, home string) api.HostInfo {
	t.Helper()
	var b []byte
	var err error
	for deadline := time.Now().Add(15 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if b, err = os.ReadFile(filepath.Join(home, "host_info.json")); err == nil {
			break
		}
	}
	var hi api.HostInfo
	if err != nil || json.Unmarshal(b, &hi) != nil {
		t.Fatalf("host_info.json: %v %s", err, b)
	}
	return hi
}

// inspectOn inspects a container on the Docker at host ("" the machine's)
// and decodes its GPUs as a restarted shim's recovery does (dockerrt).
func inspectOn(t *testing.T, host, id string) (container.InspectResponse, []string) {
	t.Helper()
	opts := []client.Opt{client.FromEnv, client.WithAPIVersionNegotiation()}
	if host != "" {
		opts = append(opts, client.WithHost(host))
		t.Setenv("DOCKER_HOST", host)
	}
	c, err := client.NewClientWithOpts(opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	ins, err := c.ContainerInspect(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	rt, err := dockerrt.New()
	if err != nil {
		t.Fatal(err)
	}
	defer rt.Close()
	st, err := rt.Inspect(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	return ins, st.GPUIDs
}

// TestShimDrivesGaudiFromAFixtureHostRoot (issue 66): the shim binary on an
// 8-card Gaudi2 fixture tree (no hl-smi here: names and memory from the
// driver's type) reports dstack's instance info and host_info, and a task
// of two cards is created as dstack's shim creates it: Docker's habana
// runtime (a private dockerd where "habana" is a runc wrapper that notes
// the HABANA_VISIBLE_DEVICES the bundle carries, as the real runtime reads
// it), host IPC, SYS_NICE; recovery reads the cards back from Docker.
func TestShimDrivesGaudiFromAFixtureHostRoot(t *testing.T) {
	testenv.RequireDocker(t)
	root := t.TempDir()
	gpufixture.Gaudi2Host(t, root)
	runc, err := exec.LookPath("runc")
	if err != nil {
		t.Fatalf("runc: %v", err)
	}
	dir := t.TempDir()
	seen := filepath.Join(dir, "habana-seen")
	wrapper := filepath.Join(dir, "habana-runtime")
	writeFile(t, wrapper, fmt.Sprintf(`#!/bin/sh
prev=
for a in "$@"; do
	if [ "$prev" = --bundle ]; then grep -o 'HABANA_VISIBLE_DEVICES=[0-9,]*' "$a/config.json" >> %s; fi
	prev=$a
done
exec %s "$@"
`, seen, runc), 0o755)
	host, _ := privateDockerd(t, nil, "--add-runtime", "habana="+wrapper)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	load := exec.CommandContext(ctx, "sh", "-c", `docker save "$1" | DOCKER_HOST="$2" docker load -q`, "sh", testenv.Busybox(t), host)
	if out, err := load.CombinedOutput(); err != nil {
		t.Fatalf("load busybox: %v %s", err, out)
	}

	h := startShim(t, testenv.Binaries(t).Runner, []string{"DOCKER_HOST=" + host, "DSTACK_SERVICE_MODE=1"}, "--host-root", root)
	info, err := h.client.InstanceInfo(ctx)
	if err != nil || info != (api.InstanceInfoResponse{GPUVendor: api.GPUVendorIntel, GPUDriverVersion: "1.19.1-6f47ddd"}) {
		t.Fatalf("instance info: %+v %v", info, err)
	}
	if ih, err := h.client.InstanceHost(ctx); err != nil || ih.GPUCount != 8 {
		t.Fatalf("instance host: %+v %v", ih, err)
	}
	if hi := hostInfoOf(t, h.home); hi.GPUVendor != api.GPUVendorIntel || hi.GPUName != "Gaudi2" || hi.GPUMemory != 98304 || hi.GPUCount != 8 {
		t.Fatalf("host info: %+v", hi)
	}

	cfg := h.submit(api.TaskConfig{GPU: 2})
	ti := h.wait(cfg.ID, 2*time.Minute, running)
	if !slices.Equal(ti.GPUIDs, []string{"0", "1"}) {
		t.Fatalf("task GPUs: %+v", ti)
	}
	ins, decoded := inspectOn(t, host, ti.ContainerID)
	hc := ins.HostConfig
	if hc.Runtime != "habana" || !hc.IpcMode.IsHost() || len(hc.CapAdd) != 1 || strings.TrimPrefix(hc.CapAdd[0], "CAP_") != "SYS_NICE" || len(hc.DeviceRequests) != 0 ||
		!slices.Contains(ins.Config.Env, "HABANA_VISIBLE_DEVICES=0,1") {
		t.Fatalf("container: runtime %q ipc %q caps %v requests %v env %v", hc.Runtime, hc.IpcMode, hc.CapAdd, hc.DeviceRequests, ins.Config.Env)
	}
	if b, _ := os.ReadFile(seen); strings.TrimSpace(string(b)) != "HABANA_VISIBLE_DEVICES=0,1" {
		t.Fatalf("the habana runtime saw %q", b)
	}
	if !slices.Equal(decoded, []string{"0", "1"}) {
		t.Fatalf("recovery decodes %v", decoded)
	}
	// The next task gets the other cards, the first NUMA node's first.
	next := h.wait(h.submit(api.TaskConfig{GPU: 2}).ID, 2*time.Minute, running)
	if !slices.Equal(next.GPUIDs, []string{"2", "3"}) {
		t.Fatalf("second task's GPUs: %v", next.GPUIDs)
	}
}

// TestShimDrivesTenstorrentFromAFixtureHostRoot (issue 66): the shim binary
// on a fixture of two n300 cards (four chips, two on the bus) reports two
// cards of 24 GiB, and a task of one card gets, in the machine's Docker,
// that card's device node (a character device standing for it under the
// fixture root) at /dev/tenstorrent/<id> and the host's 1 GiB hugepages;
// recovery reads the card back from Docker.
func TestShimDrivesTenstorrentFromAFixtureHostRoot(t *testing.T) {
	testenv.RequireDocker(t)
	root := t.TempDir()
	gpufixture.TenstorrentHost(t, root, "n300", 2)
	for i := 0; i < 2; i++ {
		node := filepath.Join(root, "dev", "tenstorrent", fmt.Sprint(i))
		_ = os.MkdirAll(filepath.Dir(node), 0o755)
		if err := unix.Mknod(node, unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))); err != nil {
			if testenv.InCI() {
				t.Fatalf("mknod: %v", err)
			}
			t.Skipf("mknod: %v", err)
		}
	}
	hugepages := filepath.Join(root, "dev", "hugepages-1G")
	if err := os.MkdirAll(hugepages, 0o755); err != nil {
		t.Fatal(err)
	}

	h := startShim(t, testenv.Binaries(t).Runner, []string{"DSTACK_SERVICE_MODE=1"}, "--host-root", root)
	ctx := context.Background()
	info, err := h.client.InstanceInfo(ctx)
	if err != nil || info != (api.InstanceInfoResponse{GPUVendor: api.GPUVendorTenstorrent, GPUDriverVersion: "2.0.0"}) {
		t.Fatalf("instance info: %+v %v", info, err)
	}
	if ih, err := h.client.InstanceHost(ctx); err != nil || ih.GPUCount != 2 {
		t.Fatalf("instance host: %+v %v", ih, err)
	}
	if hi := hostInfoOf(t, h.home); hi.GPUVendor != api.GPUVendorTenstorrent || hi.GPUName != "n300" || hi.GPUMemory != 24576 || hi.GPUCount != 2 {
		t.Fatalf("host info: %+v", hi)
	}

	cfg := h.submit(api.TaskConfig{GPU: 1})
	ti := h.wait(cfg.ID, 2*time.Minute, running)
	if !slices.Equal(ti.GPUIDs, []string{"0"}) {
		t.Fatalf("task GPUs: %+v", ti)
	}
	ins, decoded := inspectOn(t, "", ti.ContainerID)
	want := container.DeviceMapping{PathOnHost: filepath.Join(root, "dev/tenstorrent/0"), PathInContainer: "/dev/tenstorrent/0", CgroupPermissions: "rwm"}
	if !slices.Contains(ins.HostConfig.Devices, want) || ins.HostConfig.Runtime == "habana" {
		t.Fatalf("devices %+v", ins.HostConfig.Devices)
	}
	bound := false
	for _, m := range ins.HostConfig.Mounts {
		bound = bound || (m.Source == hugepages && m.Target == "/dev/hugepages-1G")
	}
	if !bound {
		t.Fatalf("no hugepages bind: %+v", ins.HostConfig.Mounts)
	}
	if !slices.Equal(decoded, []string{"0"}) {
		t.Fatalf("recovery decodes %v", decoded)
	}
	// The node is in the container, the other card's is not.
	out, err := testenv.Docker(ctx, "exec", ti.ContainerID, "sh", "-c", "ls /dev/tenstorrent; test -d /dev/hugepages-1G && echo hugepages")
	if err != nil || strings.Fields(out)[0] != "0" || len(strings.Fields(out)) != 2 {
		t.Fatalf("in the container: %q %v", out, err)
	}
}
