package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/e2e/testenv"
)

// A shim lives for weeks of tasks: every task's whole life, however it
// ends, gives back what it took. After two dozen lifecycles of every kind
// (jobs that finish, fail, or are stopped; host and bridge networks, whose
// ports the shim forwards; a stop right after the submit) the shim holds
// the descriptors, threads and goroutines it held after the first two,
// and nothing of the tasks is left on the host: no mount, loop device,
// runner dir, record, forwarder or container.
func TestShimTaskLifecyclesLeakNothing(t *testing.T) {
	// The stand-in runner ends as its task's id says.
	runner := runnerScript(t, `case "$TANDEM_TASK_ID" in
*-exit0-*) exit 0 ;;
*-exit3-*) echo failed on purpose; exit 3 ;;
*) exec sleep 3600 ;;
esac`)
	h := startShim(t, runner, nil)
	ctx := context.Background()
	pid := h.cmd.Process.Pid

	type kind struct {
		name, network string
		end           func(id string) api.TaskInfoResponse
	}
	stop := func(id string) api.TaskInfoResponse {
		h.wait(id, time.Minute, running)
		h.terminate(id, api.ReasonTerminatedByUser, "", 0)
		return h.wait(id, time.Minute, terminated)
	}
	byItself := func(id string) api.TaskInfoResponse { return h.wait(id, time.Minute, terminated) }
	stopAtOnce := func(id string) api.TaskInfoResponse {
		h.terminate(id, api.ReasonTerminatedByUser, "", 0)
		return h.wait(id, time.Minute, terminated)
	}
	kinds := []kind{
		{"exit0", "host", byItself},
		{"exit3", "bridge", byItself},
		{"stop", "host", stop},
		{"stop", "bridge", stop},
		{"early", "bridge", stopAtOnce},
		{"exit0", "bridge", byItself},
	}
	var ids []string
	lifecycle := func(k kind) {
		t.Helper()
		cfg := h.submit(api.TaskConfig{ID: randomID("leak-" + k.name), NetworkMode: k.network})
		ids = append(ids, cfg.ID)
		// A poller's and a scraper's calls on the way.
		if _, err := h.client.ListTasks(ctx); err != nil {
			t.Fatal(err)
		}
		scrape(t, h)
		info := k.end(cfg.ID)
		if k.name == "exit3" && info.TerminationReason != api.ReasonContainerExitedWithError {
			t.Fatalf("%s on %s ended %s: %s", k.name, k.network, info.TerminationReason, info.TerminationMessage)
		}
		if err := h.client.RemoveTask(ctx, cfg.ID); err != nil {
			t.Fatalf("remove %s: %v", cfg.ID, err)
		}
	}
	// Two warm-up lifecycles: the runner dirs' template and ready copy,
	// the task network, pools of buffers and connections.
	lifecycle(kinds[2])
	lifecycle(kinds[3])
	base := holdings(t, pid, h)
	for range 4 {
		for _, k := range kinds {
			lifecycle(k)
		}
	}
	// What a task gives back is given back by the time it is removed; a
	// moment is allowed for goroutines on their way out.
	var now held
	for i := 0; ; i++ {
		now = holdings(t, pid, h)
		if now.fds <= base.fds+2 && now.goroutines <= base.goroutines+3 && now.threads <= base.threads+2 {
			break
		}
		if i > 50 {
			t.Fatalf("after %d lifecycles the shim holds more than after 2:\nbase: %+v\nnow:  %+v", len(ids), base, now)
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("after 2 lifecycles: %+v", base)
	t.Logf("after %d: %+v", len(ids), now)

	// Nothing of the tasks on the host.
	if m := mountsUnder(t, h.home); len(m) > 0 {
		t.Fatalf("mounts left under the shim home: %v", m)
	}
	if l := loopsUnder(t, h.home); len(l) > 0 {
		t.Fatalf("loop devices left on the shim home's images: %v", l)
	}
	entries, err := os.ReadDir(filepath.Join(h.home, "runners"))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), ".") { // the template, the ready copy, the host fs probe
			t.Fatalf("runner dir or image left: %s", e.Name())
		}
	}
	if left, _ := os.ReadDir(filepath.Join(h.home, "tasks")); len(left) > 0 {
		t.Fatalf("task records left: %v", left)
	}
	for _, id := range ids {
		out, err := testenv.Docker(ctx, "ps", "-aq", "--filter", "label=ai.dstack.shim.task-id="+id)
		if err != nil || strings.TrimSpace(out) != "" {
			t.Fatalf("container of task %s left: %q %v", id, out, err)
		}
	}
	if list, err := h.client.ListTasks(ctx); err != nil || len(list) != 0 {
		t.Fatalf("tasks still listed: %+v %v", list, err)
	}
}

// held is what the shim process holds.
type held struct {
	fds, threads, goroutines int
}

func holdings(t *testing.T, pid int, h *shimHarness) held {
	t.Helper()
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	var out held
	out.fds = len(fds)
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(status)) {
		if v, ok := strings.CutPrefix(line, "Threads:"); ok {
			out.threads, _ = strconv.Atoi(strings.TrimSpace(v))
		}
	}
	out.goroutines = int(scrape(t, h)["go_goroutines"])
	return out
}

// scrape reads the shim's /metrics: each unlabelled sample by name.
func scrape(t *testing.T, h *shimHarness) map[string]float64 {
	t.Helper()
	resp, err := http.Get(strings.TrimSuffix(h.client.BaseURL(), "/") + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("metrics: %s %s", resp.Status, b)
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		name, value, ok := strings.Cut(sc.Text(), " ")
		if !ok || strings.HasPrefix(name, "#") || strings.Contains(name, "{") {
			continue
		}
		if v, err := strconv.ParseFloat(value, 64); err == nil {
			out[name] = v
		}
	}
	return out
}

// mountsUnder lists the mount points under dir (this test's mount
// namespace is the shim's).
func mountsUnder(t *testing.T, dir string) []string {
	t.Helper()
	raw, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for line := range strings.Lines(string(raw)) {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], dir+"/") {
			out = append(out, f[4])
		}
	}
	return out
}

// loopsUnder lists the loop devices whose backing file is under dir.
func loopsUnder(t *testing.T, dir string) []string {
	t.Helper()
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	var out []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err == nil && strings.HasPrefix(strings.TrimSpace(string(b)), dir+"/") {
			out = append(out, filepath.Base(filepath.Dir(filepath.Dir(f)))+": "+strings.TrimSpace(string(b)))
		}
	}
	return out
}
