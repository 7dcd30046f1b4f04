package e2e

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/procs"
	"github.com/tandem-run/tandem/e2e/testenv"
)

// A shim lives for weeks of tasks: every task's whole life, however it
// ends, gives back what it took. After two dozen lifecycles of every kind
// (jobs that finish, fail, or are stopped; host and bridge networks, whose
// ports the shim forwards; a stop right after the submit) the shim holds
// the descriptors and goroutines it held after the first two (threads
// within threadSlack), and nothing of the tasks is left on the host: no
// mount, loop device, runner dir, record, forwarder or container.
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
		shimMetrics(t, h)
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
		if now.fds <= base.fds+2 && now.goroutines <= base.goroutines+3 && now.threads <= base.threads+threadSlack {
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

// threadSlack is how many threads a process may gain over a test's
// lifecycles without a leak: Go keeps the threads that blocking system
// calls needed at once, and a busy machine needs more of them at some
// moment; a thread lost per lifecycle (a locked goroutine that never
// ends) is 20 or more.
const threadSlack = 8

// held is what the shim process holds.
type held struct {
	procHeld
	goroutines int
}

func holdings(t *testing.T, pid int, h *shimHarness) held {
	t.Helper()
	return held{procHoldings(t, pid), goroutines(t, h)}
}

// goroutines is the shim's go_goroutines sample.
func goroutines(t *testing.T, h *shimHarness) int {
	t.Helper()
	for line := range strings.Lines(shimMetrics(t, h)) {
		if v, ok := strings.CutPrefix(line, "go_goroutines "); ok {
			n, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				t.Fatalf("go_goroutines %q: %v", v, err)
			}
			return int(n)
		}
	}
	t.Fatal("the shim's metrics have no go_goroutines")
	return 0
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

// The runner gives back what each client took, however it goes: SSH
// logins, sessions with and without a pty, -L and -R forwards whose
// client is killed mid-stream, file copies, connections that send garbage
// or nothing before they close; the log stream's WebSocket and an API
// request dropped halfway. After twenty rounds the runner holds the
// descriptors it held after two (threads within threadSlack), and no
// session's process is left in the container.
func TestRunnerClientsLeakNothing(t *testing.T) {
	r := startSSHRunner(t, testenv.Busybox(t))
	pid := runnerPID(t, r.container)
	apiPort := portOf(t, r.runnerHarness)
	round := func() {
		t.Helper()
		if out, code := r.ssh(t, "root", nil, "true"); code != 0 {
			t.Fatalf("ssh true: %d %q", code, out)
		}
		if out, code := r.ssh(t, "root", []string{"-tt"}, "echo pty"); code != 0 || !strings.Contains(out, "pty") {
			t.Fatalf("ssh -tt: %d %q", code, out)
		}
		// -L through to the runner's API, then the client killed.
		local := testenv.FreeAddr(t)
		fwd := exec.Command("ssh", r.sshArgs("root", "-N", "-L", local+":127.0.0.1:"+apiPort)...)
		testenv.Isolate(fwd)
		if err := fwd.Start(); err != nil {
			t.Fatal(err)
		}
		if body := httpGetRetry(t, "http://"+local+"/api/healthcheck"); !strings.Contains(body, "dstack-runner") {
			t.Fatalf("-L: %q", body)
		}
		// A stream left open through the forward when the client dies.
		if c, err := net.Dial("tcp", local); err == nil {
			_, _ = c.Write([]byte("GET /api/healthcheck HTTP/1.1\r\nHost: x\r\n"))
			defer c.Close()
		}
		_ = fwd.Process.Kill()
		_ = fwd.Wait()
		// -R, its client killed while the listener is open.
		remote := testenv.FreeAddr(t)
		rev := exec.Command("ssh", r.sshArgs("root", "-N", "-R", remote+":127.0.0.1:"+apiPort)...)
		testenv.Isolate(rev)
		if err := rev.Start(); err != nil {
			t.Fatal(err)
		}
		for i := 0; ; i++ {
			if c, err := net.Dial("tcp", remote); err == nil {
				c.Close()
				break
			}
			if i > 200 {
				t.Fatal("the -R listener never opened")
			}
			time.Sleep(20 * time.Millisecond)
		}
		_ = rev.Process.Kill()
		_ = rev.Wait()
		// A file copied in.
		src := filepath.Join(t.TempDir(), "f")
		if err := os.WriteFile(src, []byte("payload"), 0o644); err != nil {
			t.Fatal(err)
		}
		scp := exec.Command("scp", append(append([]string{"-P", r.sshPort}, scpOpts(r)...), src, "root@127.0.0.1:/tmp/f")...)
		if out, err := scp.CombinedOutput(); err != nil {
			t.Fatalf("scp: %v %s", err, out)
		}
		// The log stream's WebSocket, dropped mid-stream; an API
		// connection dropped mid-request.
		if c, err := net.Dial("tcp", "127.0.0.1:"+apiPort); err == nil {
			_, _ = c.Write([]byte("GET /logs_ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n" +
				"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"))
			_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
			if line, err := bufio.NewReader(c).ReadString('\n'); err != nil || !strings.Contains(line, "101") {
				t.Fatalf("logs_ws: %q %v", line, err)
			}
			c.Close()
		}
		if c, err := net.Dial("tcp", "127.0.0.1:"+apiPort); err == nil {
			_, _ = c.Write([]byte("POST /api/submit HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"))
			c.Close()
		}
		// SSH: garbage, then nothing at all.
		if c, err := net.Dial("tcp", "127.0.0.1:"+r.sshPort); err == nil {
			_, _ = c.Write([]byte("\x00\xffnot ssh\r\n"))
			c.Close()
		}
		if c, err := net.Dial("tcp", "127.0.0.1:"+r.sshPort); err == nil {
			c.Close()
		}
	}
	round()
	round()
	base := procHoldings(t, pid)
	for range 20 {
		round()
	}
	var now procHeld
	for i := 0; ; i++ {
		now = procHoldings(t, pid)
		if now.fds <= base.fds+2 && now.threads <= base.threads+threadSlack && now.children <= base.children {
			break
		}
		if i > 100 {
			t.Fatalf("after 22 rounds the runner holds more than after 2:\nbase: %+v\nnow:  %+v", base, now)
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("after 2 rounds: %+v; after 22: %+v", base, now)
}

// scpOpts are the ssh options of r's client for scp (its -P, not -p).
func scpOpts(r *sshRunner) []string {
	args := r.sshArgs("root")
	var out []string
	for i := 0; i < len(args)-1; i++ {
		if args[i] == "-p" {
			i++
			continue
		}
		out = append(out, args[i])
	}
	return out
}

// runnerPID is the host pid of the runner in container (docker's init's
// child).
func runnerPID(t *testing.T, container string) int {
	t.Helper()
	out, err := testenv.Docker(context.Background(), "inspect", "-f", "{{.State.Pid}}", container)
	if err != nil {
		t.Fatal(err)
	}
	init := strings.TrimSpace(out)
	for _, p := range descendants(t, init) {
		if comm, _ := os.ReadFile("/proc/" + p + "/comm"); strings.TrimSpace(string(comm)) == "dstack-runner" {
			pid, _ := strconv.Atoi(p)
			return pid
		}
	}
	t.Fatalf("no dstack-runner under the container's init %s", init)
	return 0
}

// descendants lists pid's descendants, depth first.
func descendants(t *testing.T, pid string) []string {
	t.Helper()
	var out []string
	tasks, _ := filepath.Glob("/proc/" + pid + "/task/*/children")
	for _, f := range tasks {
		b, _ := os.ReadFile(f)
		for _, c := range strings.Fields(string(b)) {
			out = append(out, c)
			out = append(out, descendants(t, c)...)
		}
	}
	return out
}

// procHeld is what a process holds: descriptors, threads, and processes
// under it.
type procHeld struct {
	fds, threads, children int
}

func procHoldings(t *testing.T, pid int) procHeld {
	t.Helper()
	// num_threads is stat field 20.
	f, err := procs.StatFields(fmt.Sprintf("/proc/%d", pid))
	if err != nil || len(f) < 18 {
		t.Fatalf("stat of %d: %d fields, %v", pid, len(f), err)
	}
	threads, err := strconv.Atoi(f[17])
	if err != nil {
		t.Fatal(err)
	}
	return procHeld{fds: openFDs(pid), threads: threads, children: len(descendants(t, strconv.Itoa(pid)))}
}
