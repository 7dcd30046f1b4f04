package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/e2e/testenv"
	"github.com/tandem-run/tandem/internal/loopdev"
)

func isMounted(dir string) bool { return exec.Command("mountpoint", "-q", dir).Run() == nil }

// Network volumes through the real shim: a loop device stands in for a GCP
// persistent disk (a fixture /dev/disk/by-id points at it).
func TestShimVolumesEndToEnd(t *testing.T) {
	dev := loopdev.New(t, 64, false)
	byID := t.TempDir()
	if err := os.Symlink(dev, filepath.Join(byID, "google-train-data")); err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()
	// The stand-in runner writes to the volume, then waits for /ctl/exit.
	p := newShimProc(t, runnerScript(t, `echo "$(date) from $HOSTNAME" >> /data/log.txt; cat /data/log.txt; `+exitOnFile))
	args := []string{"--volumes-root", root, "--gcp-disk-by-id", byID}
	p.start(args...)
	ctx := context.Background()
	vol := api.VolumeInfo{Backend: "gcp", Name: "train-data", VolumeID: "pd-123", DeviceName: "train-data", InitFS: true}
	mp := filepath.Join(root, "train-data")
	run := func(id string) (api.TaskConfig, string) {
		ctl := t.TempDir()
		cfg := api.TaskConfig{ID: id, Name: "rs-" + strings.ToLower(randomID("v")), ImageName: testenv.Busybox(t),
			Volumes: []api.VolumeInfo{vol}, VolumeMounts: []api.VolumeMountPoint{{Name: "train-data", Path: "/data"}},
			InstanceMounts: []api.InstanceMountPoint{{InstancePath: ctl, Path: "/ctl"}}}
		if err := p.client.SubmitTask(ctx, cfg); err != nil {
			t.Fatal(err)
		}
		return cfg, ctl
	}

	// 1: formatted (fresh disk), written, unmounted after the task exits.
	a, ctlA := run(randomID("va"))
	p.waitStatus(a.ID, running)
	if !isMounted(mp) {
		t.Fatal("volume not mounted while the task runs")
	}
	// A second task asking for the same volume fails clearly.
	b, _ := run(randomID("vb"))
	ib := p.waitStatus(b.ID, terminated)
	if ib.TerminationReason != api.ReasonExecutorError || !strings.Contains(ib.TerminationMessage, "volume train-data is mounted for task "+a.ID) {
		t.Fatalf("second user: %+v", ib)
	}
	if !isMounted(mp) {
		t.Fatal("the failed second task must not unmount the first one's volume")
	}
	_ = os.WriteFile(filepath.Join(ctlA, "exit"), []byte("0"), 0o644)
	p.waitStatus(a.ID, terminated)
	if isMounted(mp) {
		t.Fatal("volume still mounted after the task ended")
	}

	// 2: the next task sees the first one's file (not reformatted); kill -9
	// the shim mid-task; the restarted shim unmounts once at the end.
	c, ctlC := run(randomID("vc"))
	p.waitStatus(c.ID, running)
	p.kill9()
	p.start(args...)
	p.waitStatus(c.ID, running)
	if !isMounted(mp) {
		t.Fatal("a restart must not unmount a running task's volume")
	}
	_ = os.WriteFile(filepath.Join(ctlC, "exit"), []byte("0"), 0o644)
	ic := p.waitStatus(c.ID, terminated)
	if isMounted(mp) {
		t.Fatal("volume still mounted after the restarted shim saw the task end")
	}
	logs, _ := testenv.Docker(ctx, "logs", ic.ContainerID)
	if strings.Count(logs, "from ") != 2 {
		t.Fatalf("the second task must see the first task's line (no reformat): %q", logs)
	}

	// 3: terminate also unmounts.
	d, _ := run(randomID("vd"))
	p.waitStatus(d.ID, running)
	if _, err := p.client.TerminateTask(ctx, d.ID, api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser}); err != nil {
		t.Fatal(err)
	}
	if isMounted(mp) {
		t.Fatal("volume still mounted after terminate")
	}
	for _, id := range []string{a.ID, b.ID, c.ID, d.ID} {
		if err := p.client.RemoveTask(ctx, id); err != nil {
			t.Fatalf("remove %s: %v", id, err)
		}
	}
}
