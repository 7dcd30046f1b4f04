package e2e

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/shimclient"
	"github.com/tandem-run/tandem/e2e/testenv"
	"github.com/tandem-run/tandem/shim/task"
)

// foreignTask is a task container another agent runs on this Docker.
type foreignTask struct {
	id, name string
}

// otherAgentsTask runs a container shaped like a task container of
// dstack's own shim at dstackHome (its two labels, its runner dir bound at
// /tmp/runner) or, with labelHome, of a Tandem shim at that home. A
// finished one (detached false) has run to its end, as a done task that
// prune would take; it is removed when the test ends.
func otherAgentsTask(t *testing.T, img, dstackHome, labelHome string, detached bool) foreignTask {
	t.Helper()
	f := foreignTask{id: randomID("foreign")}
	f.name = task.ContainerName("other-run", f.id)
	dir := filepath.Join(dstackHome, "runners", f.name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	args := []string{"run", "--name", f.name, "--label", task.LabelIsTask + "=true", "--label", task.LabelTaskID + "=" + f.id,
		"--mount", "type=bind,source=" + dir + ",target=" + task.RunnerDirInContainer}
	if labelHome != "" {
		args = append(args, "--label", task.LabelShimHome+"="+labelHome)
	}
	cmd := []string{img, "true"}
	if detached {
		args = append(args, "-d")
		cmd = []string{img, "sleep", "600"}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if out, err := testenv.Docker(ctx, append(args, cmd...)...); err != nil {
		t.Fatalf("docker run %s: %v %s", f.name, err, out)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, _ = testenv.Docker(ctx, "rm", "-f", "-v", f.name)
	})
	return f
}

// waitLog waits until the shim at home has logged a line holding want (its
// first reconcile has run), and returns that line.
func waitLog(t *testing.T, home, want string) string {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		b, _ := os.ReadFile(filepath.Join(home, "shim.log"))
		for line := range strings.SplitSeq(string(b), "\n") {
			if strings.Contains(line, want) {
				return line
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the shim did not log %q:\n%s", want, b)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func notFound(t *testing.T, c *shimclient.Client, id string) bool {
	t.Helper()
	_, err := c.GetTask(context.Background(), id)
	return errors.Is(err, api.ErrNotFound)
}

// TestScratchShimLeavesOtherAgentsTasksAlone: a shim with a scratch home
// (make demo's, one started by hand) beside the dstack server's tasks, run
// by dstack's own shim (unlabelled), and another Tandem shim's lists none
// of them, and neither tandem prune nor rm nor a task of the same name and
// id removes or stops any. A shim that runs with dstack's home (the
// migration, replacing dstack's shim) adopts dstack's, and so does one
// started with --adopt-unlabeled; neither takes the other shim's.
func TestScratchShimLeavesOtherAgentsTasksAlone(t *testing.T) {
	testenv.RequireDocker(t)
	img := testenv.Busybox(t)
	dstackHome := filepath.Join(t.TempDir(), ".dstack")
	otherHome := t.TempDir()
	running := otherAgentsTask(t, img, dstackHome, "", true)
	done := otherAgentsTask(t, img, dstackHome, "", false)
	otherShims := otherAgentsTask(t, img, otherHome, otherHome, false)
	foreign := []foreignTask{running, done, otherShims}

	runner := runnerScript(t, "sleep 600")
	h := startShim(t, runner, nil)
	run := tandemAt(t, t.TempDir(), h.addr())
	// ps answers once the shim restored its tasks: its first reconcile
	// with Docker's containers is behind it.
	out, errOut, code := run("ps", "-a")
	for deadline := time.Now().Add(30 * time.Second); code != 0 && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
		out, errOut, code = run("ps", "-a")
	}
	if code != 0 {
		t.Fatalf("ps -a: %d %s", code, errOut)
	}
	for _, f := range foreign {
		if strings.Contains(out, f.id) || strings.Contains(out, f.name) {
			t.Fatalf("ps -a lists another agent's task %s:\n%s", f.name, out)
		}
	}
	if out, errOut, code := run("prune"); code != 0 {
		t.Fatalf("prune: %d %s %s", code, out, errOut)
	}
	for _, f := range foreign {
		if _, _, code := run("rm", "-f", f.id); code == 0 {
			t.Errorf("rm -f %s succeeded", f.id)
		}
		if !notFound(t, h.client, f.id) {
			t.Errorf("the shim knows another agent's task %s", f.id)
		}
	}
	// A task submitted under the running one's name and id (its container
	// name is the same) fails to create; removing it leaves the other
	// agent's container.
	same := h.submit(api.TaskConfig{ID: running.id, Name: "other-run"})
	if info := h.wait(same.ID, time.Minute, terminated); info.TerminationReason != api.ReasonCreatingContainerError {
		t.Fatalf("a task under another agent's container name: %+v", info)
	}
	h.names = nil // the harness would rm -f the name: it is not this task's
	if err := h.client.RemoveTask(context.Background(), same.ID); err != nil {
		t.Fatal(err)
	}
	for _, f := range foreign {
		if !containerExists(t, f.name) {
			t.Fatalf("another agent's container %s was removed", f.name)
		}
	}
	if st, _ := testenv.Docker(context.Background(), "inspect", "--format", "{{.State.Running}}", running.name); strings.TrimSpace(st) != "true" {
		t.Fatalf("another agent's running container was stopped: %s", st)
	}
	line := waitLog(t, h.home, "left other agents' task containers alone")
	if !strings.Contains(line, "unlabelled=") || !strings.Contains(line, "labelled_other_home=") {
		t.Fatalf("the start log does not say how many and why: %s", line)
	}

	// The migration: this shim replaces dstack's and runs with its home.
	m := startShim(t, runner, nil, "--shim-home", dstackHome)
	if info := m.wait(running.id, 30*time.Second, func(i api.TaskInfoResponse) bool { return i.Status == api.TaskRunning }); info.ContainerName != running.name {
		t.Fatalf("adopted: %+v", info)
	}
	m.wait(done.id, 30*time.Second, terminated)
	if !notFound(t, m.client, otherShims.id) {
		t.Fatal("the shim at dstack's home adopted another shim's task")
	}
	// The flag: dstack's tasks seen from a scratch home.
	a := startShim(t, runner, nil, "--adopt-unlabeled")
	a.wait(running.id, 30*time.Second, func(i api.TaskInfoResponse) bool { return i.Status == api.TaskRunning })
	a.wait(done.id, 30*time.Second, terminated)
	if !notFound(t, a.client, otherShims.id) {
		t.Fatal("--adopt-unlabeled adopted another shim's task")
	}
}
