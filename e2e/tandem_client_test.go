package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/ctl"
	"github.com/tandem-run/tandem/e2e/testenv"
	"github.com/tandem-run/tandem/shim/task"
)

// tandemIn runs tandem with HOME and tandem's ssh config in dir (so tests
// never touch the real ones) plus env.
func tandemIn(t *testing.T, dir string, env []string, args ...string) (*exec.Cmd, *bytes.Buffer, *bytes.Buffer) {
	t.Helper()
	cmd, out, errb := tandem(t, args...)
	cmd.Env = append(os.Environ(), append([]string{"HOME=" + dir, "TANDEM_SSH_CONFIG=" + filepath.Join(dir, "tandem_ssh_config")}, env...)...)
	return cmd, out, errb
}

// TestTandemDetachAttachRmPrune: a detached run prints its name and id and
// exits while the job runs; ps shows it (name, image, job state) without
// consuming its end; attach by name replays the output from the start and
// exits with the job's status; rm refuses a running task without --force;
// prune removes finished tasks only. No runner port is given anywhere: the
// shim's task details say where the runner answers.
func TestTandemDetachAttachRmPrune(t *testing.T) {
	h, shim, _ := realStack(t)
	dir := t.TempDir()
	start := time.Now()
	// The host network: a bridge task's start takes Docker's network setup
	// (seconds on a loaded machine), which says nothing of whether run -d
	// waits for the job.
	run, out, errb := tandemIn(t, dir, nil, "run", "-d", "--network", "host", "--shim", shim, "--image", h.image, "--name", "train-1", "--",
		"/bin/sh", "-c", "echo start-of-job; sleep 3; echo end-of-job; exit 4")
	if err := run.Run(); err != nil {
		t.Fatalf("run -d: %v %s %s", err, out, errb)
	}
	if took := time.Since(start); took > 3*time.Second {
		t.Fatalf("run -d waited for the job: %s", took)
	}
	f := strings.Fields(out.String())
	if len(f) != 2 || f[0] != "train-1" || len(f[1]) != 36 {
		t.Fatalf("run -d printed %q, want NAME ID", out)
	}
	id := f[1]

	ps, psOut, psErr := tandemIn(t, dir, nil, "ps", "--shim", shim)
	if err := ps.Run(); err != nil {
		t.Fatalf("ps: %v %s", err, psErr)
	}
	lines := strings.Split(strings.TrimSpace(psOut.String()), "\n")
	if len(lines) != 2 || !strings.HasPrefix(lines[0], "NAME") {
		t.Fatalf("ps:\n%s", psOut)
	}
	row := strings.Fields(lines[1])
	if row[0] != "train-1" || row[1] != id[:8] || row[2] != h.image || row[3] != "job" || row[4] != "running" {
		t.Fatalf("ps row %q", row)
	}
	ps, psOut, _ = tandemIn(t, dir, nil, "ps", "--shim", shim, "-o", "json")
	var rows []map[string]any
	if err := ps.Run(); err != nil || json.Unmarshal(psOut.Bytes(), &rows) != nil || len(rows) != 1 || rows[0]["name"] != "train-1" || rows[0]["id"] != id {
		t.Fatalf("ps -o json: %v %s", err, psOut)
	}

	// Wait for the job's end through ps (a peek), then attach: the output
	// from the start and the status are still there.
	deadline := time.Now().Add(30 * time.Second)
	for {
		ps, psOut, _ = tandemIn(t, dir, nil, "ps", "-a", "--shim", shim)
		_ = ps.Run()
		if strings.Contains(psOut.String(), "exited (4)") {
			if !strings.Contains(psOut.String(), " 4\n") {
				t.Fatalf("ps of a failed job shows no exit status:\n%s", psOut)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("job never ended in ps:\n%s", psOut)
		}
		time.Sleep(200 * time.Millisecond)
	}
	// Plain ps lists running jobs only, as docker ps does.
	ps, psOut, _ = tandemIn(t, dir, nil, "ps", "--shim", shim)
	if err := ps.Run(); err != nil || strings.Contains(psOut.String(), "train-1") {
		t.Fatalf("ps without -a lists an ended job: %v\n%s", err, psOut)
	}
	att, attOut, attErr := tandemIn(t, dir, nil, "attach", "--shim", shim, "train-1")
	err := att.Run()
	if exitCodeOf(err) != 4 || !strings.Contains(attOut.String(), "start-of-job") || !strings.Contains(attOut.String(), "end-of-job") ||
		!strings.Contains(attErr.String(), "exit status 4") {
		t.Fatalf("attach: exit %d\n%s\n%s", exitCodeOf(err), attOut, attErr)
	}

	// A detached job's runner leaves at the job's end and gives the host's
	// ports back: two host-network run -d in a row work, and the ended
	// one's output stays readable from the shim.
	run, out, errb = tandemIn(t, dir, nil, "run", "-d", "--network", "host", "--shim", shim, "--name", "quick-1", h.image, "/bin/sh", "-c", "echo quick-one-output")
	if err := run.Run(); err != nil {
		t.Fatalf("run -d quick-1: %v %s %s", err, out, errb)
	}
	run, out, errb = tandemIn(t, dir, nil, "run", "-d", "--network", "host", "--shim", shim, "--name", "holder", h.image, "sleep", "300")
	if err := run.Run(); err != nil {
		t.Fatalf("a second host-network run -d right after the first: %v %s %s", err, out, errb)
	}
	logs, logsOut, logsErr := tandemIn(t, dir, nil, "logs", "--shim", shim, "quick-1")
	if err := logs.Run(); err != nil || !strings.Contains(logsOut.String(), "quick-one-output") {
		t.Fatalf("logs of the ended quick-1: %v %q %q", err, logsOut, logsErr)
	}
	// While a host-network job runs, another cannot have the runner's
	// ports: the error says what to do.
	run, _, errb = tandemIn(t, dir, nil, "run", "-d", "--network", "host", "--shim", shim, "--image", h.image, "--", "true")
	if err := run.Run(); exitCodeOf(err) != 125 || !strings.Contains(errb.String(), "--network bridge") ||
		!strings.Contains(errb.String(), "task holder runs on the host network") {
		t.Fatalf("second host-network task: %v %s", err, errb)
	}
	// A name in use is refused before anything is made, as docker refuses
	// a container name until that container is removed.
	before, _ := h.client.ListTasks(t.Context())
	run, _, errb = tandemIn(t, dir, nil, "run", "-d", "--shim", shim, "--network", "bridge", "--name", "holder", h.image, "true")
	if err := run.Run(); exitCodeOf(err) != 125 || !strings.Contains(errb.String(), "name in use") || !strings.Contains(errb.String(), "tandem rm") {
		t.Fatalf("a second task named holder: %v %s", err, errb)
	}
	if after, _ := h.client.ListTasks(t.Context()); len(after) != len(before) {
		t.Fatalf("a refused name made a task: %d tasks, then %d", len(before), len(after))
	}
	rm0, _, rm0Err := tandemIn(t, dir, nil, "rm", "-f", "--shim", shim, "holder")
	if err := rm0.Run(); err != nil {
		t.Fatalf("rm -f holder: %v %s", err, rm0Err)
	}
	// rm: a running task needs --force; a unique id prefix works. In bridge
	// mode the runner's ports are the published ones, found through the shim.
	// run -d -o json exits 0 on a started job; -o takes only what it writes.
	run, out, errb = tandemIn(t, dir, nil, "run", "-d", "-o", "yaml", "--network", "bridge", "--shim", shim, "--image", h.image, "--", "true")
	if err := run.Run(); exitCodeOf(err) != 125 || !strings.Contains(errb.String(), "want text or json") {
		t.Fatalf("run -o yaml: %v %s %s", err, out, errb)
	}
	run, out, errb = tandemIn(t, dir, nil, "run", "-d", "-o", "json", "--network", "bridge", "--shim", shim, "--image", h.image, "--name", "sleeper", "--", "sleep", "300")
	var started map[string]any
	if err := run.Run(); err != nil || json.Unmarshal(out.Bytes(), &started) != nil || started["exit_code"] != float64(0) || started["detached"] != true {
		t.Fatalf("run -d -o json: %v %s %s", err, out, errb)
	}
	sleeper, _ := started["task_id"].(string)
	rm, _, rmErr := tandemIn(t, dir, nil, "rm", "--shim", shim, "sleeper")
	if err := rm.Run(); exitCodeOf(err) != 125 || !strings.Contains(rmErr.String(), "stop it first") {
		t.Fatalf("rm of a running task: %v %s", err, rmErr)
	}
	rm, rmOut, rmErr := tandemIn(t, dir, nil, "rm", "-f", "--shim", shim, sleeper[:6])
	if err := rm.Run(); err != nil || !strings.Contains(rmOut.String(), "removed\tsleeper\t"+sleeper) {
		t.Fatalf("rm -f by prefix: %v %s %s", err, rmOut, rmErr)
	}

	// prune: only finished tasks go.
	failed := h.submit(api.TaskConfig{Name: "broken", ImageName: "no-such-image:v1"})
	h.wait(failed.ID, time.Minute, terminated)
	ps, psOut, _ = tandemIn(t, dir, nil, "ps", "--shim", shim)
	_ = ps.Run()
	if strings.Contains(psOut.String(), "broken") {
		t.Fatalf("ps without -a lists a finished task:\n%s", psOut)
	}
	ps, psOut, _ = tandemIn(t, dir, nil, "ps", "-a", "--shim", shim)
	_ = ps.Run()
	if !strings.Contains(psOut.String(), "broken") || !strings.Contains(psOut.String(), "terminated (creating_container_error)") {
		t.Fatalf("ps -a:\n%s", psOut)
	}
	// A task whose job ended while its runner still lingers (status
	// running) is finished too, as rm takes it.
	// (tandem wait looked at it, so its runner lingers for the logs.)
	early, earlyOut, earlyErr := tandemIn(t, dir, nil, "run", "-d", "--shim", shim, "--network", "bridge", "--name", "ended-early", h.image, "sleep", "1")
	if err := early.Run(); err != nil {
		t.Fatalf("run -d ended-early: %v %s %s", err, earlyOut, earlyErr)
	}
	earlyID := strings.TrimSpace(strings.TrimPrefix(earlyOut.String(), "ended-early\t"))
	wait, waitOut, waitErr := tandemIn(t, dir, nil, "wait", "--shim", shim, "ended-early")
	if err := wait.Run(); err != nil || strings.TrimSpace(waitOut.String()) != "0" {
		t.Fatalf("wait ended-early: %v %q %s", err, waitOut, waitErr)
	}
	lingering := h.wait(earlyID, time.Minute, func(i api.TaskInfoResponse) bool { return ctl.JobEnded(i) || i.Status == api.TaskTerminated })
	prune, pruneOut, pruneErr := tandemIn(t, dir, nil, "prune", "--shim", shim)
	if err := prune.Run(); err != nil || !strings.Contains(pruneOut.String(), "removed\tbroken\t"+failed.ID) || strings.Contains(pruneOut.String(), id) && !strings.Contains(pruneOut.String(), "train-1") ||
		!strings.Contains(pruneOut.String(), "removed\tended-early\t"+earlyID) {
		t.Fatalf("prune (ended-early was %s when it began): %v %s %s", lingering.Status, err, pruneOut, pruneErr)
	}
	if _, err := h.client.GetTask(t.Context(), failed.ID); err == nil {
		t.Fatal("prune left the finished task")
	}
	_ = exec.Command(testenv.Binaries(t).Tandem, "rm", "-f", "--shim", shim, id).Run()
	if left := taskContainers(t); left != "" {
		t.Fatalf("containers left: %s", left)
	}
}

// TestTandemExitCodes: like docker run: the job's status, 128+N for a
// signal, 137 and "out of memory" for an OOM kill, 127/126 for a command
// that is not found or cannot run, 124 for --max-duration, 125 for
// tandem's own failures; -o json keeps stdout pure JSON.
func TestTandemExitCodes(t *testing.T) {
	h, shim, _ := realStack(t)
	dir := t.TempDir()
	for _, tc := range []struct {
		name   string
		args   []string
		code   int
		stderr string
	}{
		{"status", []string{"--", "/bin/sh", "-c", "exit 9"}, 9, "exit status 9"},
		{"SIGTERM", []string{"--", "/bin/sh", "-c", "kill -TERM $$"}, 143, "signal SIGTERM"},
		{"OOM", []string{"--memory", "96MiB", "--", "/bin/sh", "-c", "head -c 2000m /dev/zero | tail"}, 137, "out of memory"},
		{"not found", []string{"--", "no-such-command"}, 127, "not found"},
		{"not executable", []string{"--", "/etc/passwd"}, 126, "permission denied"},
		{"max duration", []string{"--max-duration", "1s", "--", "sleep", "30"}, 124, "max_duration_exceeded"},
		{"bad flag", []string{"--gpus", "lots", "--", "true"}, 125, "--gpus"},
		{"unknown flag", []string{"--no-such-flag", "--", "true"}, 125, "no-such-flag"},
		{"mixed env forms", []string{"--env", "A=1", "-e", "B=2", "--", "/bin/sh", "-c", `[ "$A$B" = 12 ]`}, 0, "job done"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"run", "--rm", "--shim", shim, "--image", h.image}, tc.args...)
			cmd, out, errb := tandemIn(t, dir, nil, args...)
			err := cmd.Run()
			if exitCodeOf(err) != tc.code || !strings.Contains(errb.String(), tc.stderr) {
				t.Fatalf("exit %d, want %d with %q:\n%s\n%s", exitCodeOf(err), tc.code, tc.stderr, out, errb)
			}
		})
	}
	// An unknown command is tandem's own failure too.
	cmd, _, errb := tandemIn(t, dir, nil, "frobnicate")
	if err := cmd.Run(); exitCodeOf(err) != 125 || !strings.Contains(errb.String(), `unknown command "frobnicate"`) {
		t.Fatalf("unknown command: %v %s", err, errb)
	}
	// -o json: stdout is one JSON document (python's json.tool reads it);
	// the job's output goes to stderr.
	cmd, out, errb := tandemIn(t, dir, nil, "run", "--rm", "-o", "json", "--shim", shim, "--image", h.image, "--", "/bin/sh", "-c", "echo job-output-line; exit 3")
	err := cmd.Run()
	check := exec.Command("python3", "-m", "json.tool")
	check.Stdin = bytes.NewReader(out.Bytes())
	if js, jerr := check.CombinedOutput(); exitCodeOf(err) != 3 || jerr != nil || !strings.Contains(string(js), `"exit_code": 3`) ||
		strings.Contains(out.String(), "job-output-line") || !strings.Contains(errb.String(), "job-output-line") {
		t.Fatalf("-o json: exit %d, json.tool %v %s\nstdout %q\nstderr %q", exitCodeOf(err), jerr, js, out, errb)
	}
	// No key: a run followed to its end works and says nothing of a key
	// it does not use; a detached one says how to fix tandem ssh into it.
	cmd, _, errb = tandemIn(t, dir, nil, "run", "--rm", "--shim", shim, "--image", h.image, "--", "true")
	if err := cmd.Run(); err != nil || strings.Contains(errb.String(), "no SSH public key found") {
		t.Fatalf("a foreground run without a key: %v %s", err, errb)
	}
	cmd, _, errb = tandemIn(t, dir, nil, "run", "-d", "--name", "no-key", "--shim", shim, "--image", h.image, "--", "true")
	if err := cmd.Run(); err != nil || !strings.Contains(errb.String(), "no SSH public key found") || !strings.Contains(errb.String(), "ssh-keygen") {
		t.Fatalf("missing key warning: %v %s", err, errb)
	}
	if cmd, _, errb := tandemIn(t, dir, nil, "rm", "-f", "--shim", shim, "no-key"); cmd.Run() != nil {
		t.Fatalf("rm -f no-key: %s", errb)
	}
	if left := taskContainers(t); left != "" {
		t.Fatalf("containers left: %s", left)
	}
}

// TestTandemCtrlCDuringStalledPull: one Ctrl-C while the registry holds the
// image's blobs ends tandem with 130 and leaves no task, fast.
func TestTandemCtrlCDuringStalledPull(t *testing.T) {
	reg := testenv.StartRegistry(t)
	reg.Push(t, uniqueImage(t, 256<<10), "tandem/held:v1")
	gateAddr, _ := blobGate(t, reg.Addr)
	h, shim, _ := realStack(t)
	dir := t.TempDir()
	cmd, out, errb := tandemIn(t, dir, []string{"TANDEM_REGISTRY_PASSWORD=" + reg.Password}, "run", "--rm", "--shim", shim,
		"--image", gateAddr+"/tandem/held:v1", "--registry-username", reg.Username, "--", "true")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	deadline := time.Now().Add(time.Minute)
	for {
		items, _ := h.client.ListTasks(t.Context())
		if len(items) == 1 && items[0].Status == api.TaskPulling {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no pulling task: %+v\n%s\n%s", items, out, errb)
		}
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond)
	sent := time.Now()
	_ = cmd.Process.Signal(syscall.SIGINT)
	select {
	case err := <-done:
		took := time.Since(sent)
		if exitCodeOf(err) != 130 || !strings.Contains(errb.String(), "interrupted") {
			t.Fatalf("exit %d after Ctrl-C during the pull:\n%s\n%s", exitCodeOf(err), out, errb)
		}
		t.Logf("Ctrl-C during a stalled pull: tandem exited 130 after %s", took.Round(time.Millisecond))
		if took > 2*time.Second {
			t.Fatalf("tandem took %s to exit after Ctrl-C", took)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("tandem ignored Ctrl-C during the pull:\n%s", errb)
	}
	if items, err := h.client.ListTasks(t.Context()); err != nil || len(items) != 0 {
		t.Fatalf("tasks left after Ctrl-C: %+v %v", items, err)
	}
}

// TestTandemSSHConfig: run -d writes a Host entry per task into tandem's
// ssh config, ssh-config --install includes it from ~/.ssh/config, and the
// real OpenSSH ssh, scp and rsync reach the task by name; rm drops the
// entry. Completion lists the task's name.
func TestTandemSSHConfig(t *testing.T) {
	_, shim, _, _ := realStackSSH(t)
	debian := testenv.Debian(t)
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, ".ssh"), 0o700); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", filepath.Join(dir, ".ssh", "id_ed25519")).CombinedOutput(); err != nil {
		t.Fatalf("%v %s", err, out)
	}
	run, out, errb := tandemIn(t, dir, nil, "run", "-d", "--shim", shim, "--image", debian, "--name", "box",
		"--mount", "/usr/bin:/opt/hostbin", "--mount", "/lib/x86_64-linux-gnu:/opt/hostlib", "--", "sleep", "300")
	if err := run.Run(); err != nil {
		t.Fatalf("run -d: %v %s %s", err, out, errb)
	}
	entries, _ := os.ReadFile(filepath.Join(dir, "tandem_ssh_config"))
	if !strings.Contains(string(entries), "\nHost tandem-box\n") || !strings.Contains(string(entries), "IdentityFile "+filepath.Join(dir, ".ssh", "id_ed25519")) {
		t.Fatalf("no entry for box after run -d:\n%s", entries)
	}
	// Another tenant's task on the same shim, named for a real host: its
	// name must never become an ssh Host of this user's.
	other, oOut, oErr := tandemIn(t, t.TempDir(), nil, "run", "-d", "--no-ssh-config", "--network", "bridge", "--shim", shim, "--image", debian, "--name", "github.com", "--", "sleep", "300")
	if err := other.Run(); err != nil {
		t.Fatalf("the other tenant's run: %v %s %s", err, oOut, oErr)
	}
	t.Cleanup(func() {
		c, _, _ := tandemIn(t, t.TempDir(), nil, "rm", "-f", "--shim", shim, "github.com")
		_ = c.Run()
	})
	// A stale entry of a task that is gone is dropped by a re-run.
	stale := "# tandem task deadbeef-0000-0000-0000-000000000000 shim " + shim + "\nHost tandem-gone\n  HostName 127.0.0.1\n"
	if b, err := os.ReadFile(filepath.Join(dir, "tandem_ssh_config")); err == nil {
		_ = os.WriteFile(filepath.Join(dir, "tandem_ssh_config"), append(b, []byte("\n"+stale+"\n")...), 0o600)
	}
	cfgCmd, cfgOut, cfgErr := tandemIn(t, dir, nil, "ssh-config", "--install", "--shim", shim)
	if err := cfgCmd.Run(); err != nil || !strings.Contains(cfgErr.String(), "1 task(s)") {
		t.Fatalf("ssh-config: %v %s %s", err, cfgOut, cfgErr)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "tandem_ssh_config")); strings.Contains(string(b), "github") || strings.Contains(string(b), "tandem-gone") ||
		!strings.Contains(string(b), "Host tandem-box\n") {
		t.Fatalf("ssh-config wrote another tenant's task or kept a gone one:\n%s", b)
	}
	userCfg := filepath.Join(dir, ".ssh", "config")
	if b, _ := os.ReadFile(userCfg); !strings.HasPrefix(string(b), "Include "+filepath.Join(dir, "tandem_ssh_config")+"\n") {
		t.Fatalf("~/.ssh/config:\n%s", b)
	}
	// Again: idempotent, one Include line.
	cfgCmd, _, _ = tandemIn(t, dir, nil, "ssh-config", "--install", "--shim", shim)
	_ = cfgCmd.Run()
	if b, _ := os.ReadFile(userCfg); strings.Count(string(b), "Include ") != 1 {
		t.Fatalf("Include added twice:\n%s", b)
	}
	sshRun := func(args ...string) string {
		t.Helper()
		out, err := exec.Command("ssh", append([]string{"-F", userCfg, "-o", "BatchMode=yes"}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("ssh %q: %v %s", args, err, out)
		}
		return string(out)
	}
	if got := sshRun("tandem-box", "cat", "/etc/debian_version"); !strings.HasPrefix(got, "12") {
		t.Fatalf("ssh box: %q", got)
	}
	local := filepath.Join(dir, "payload")
	_ = os.WriteFile(local, []byte("copied by scp\n"), 0o644)
	if out, err := exec.Command("scp", "-F", userCfg, "-o", "BatchMode=yes", local, "tandem-box:/tmp/payload").CombinedOutput(); err != nil {
		t.Fatalf("scp: %v %s", err, out)
	}
	if got := sshRun("tandem-box", "cat", "/tmp/payload"); got != "copied by scp\n" {
		t.Fatalf("after scp: %q", got)
	}
	src := filepath.Join(dir, "tree")
	_ = os.MkdirAll(filepath.Join(src, "sub"), 0o755)
	_ = os.WriteFile(filepath.Join(src, "sub", "f"), []byte("synced by rsync\n"), 0o644)
	// The image has no rsync: the host's, mounted with its libraries, serves.
	rsync := exec.Command("rsync", "-a", "-e", "ssh -F "+userCfg+" -o BatchMode=yes",
		"--rsync-path=LD_LIBRARY_PATH=/opt/hostlib /opt/hostbin/rsync", src+"/", "tandem-box:/tmp/tree/")
	if out, err := rsync.CombinedOutput(); err != nil {
		t.Fatalf("rsync: %v %s", err, out)
	}
	if got := sshRun("tandem-box", "cat", "/tmp/tree/sub/f"); got != "synced by rsync\n" {
		t.Fatalf("after rsync: %q", got)
	}
	// The entry pins the task's own host key: a different key at the same
	// place (a port another task took over) is refused.
	b, _ := os.ReadFile(filepath.Join(dir, "tandem_ssh_config"))
	if !strings.Contains(string(b), "StrictHostKeyChecking yes") || !strings.Contains(string(b), "HostKeyAlias tandem-task-") {
		t.Fatalf("the entry does not pin the host key:\n%s", b)
	}
	pins, _ := filepath.Glob(filepath.Join(dir, "known_hosts.d", "*"))
	if len(pins) != 1 {
		t.Fatalf("pin files: %v", pins)
	}
	good, _ := os.ReadFile(pins[0])
	impostor := testenv.KeyGen(t, filepath.Join(t.TempDir(), "impostor"), "ed25519")
	alias := strings.Fields(string(good))[0]
	if err := os.WriteFile(pins[0], []byte(alias+" "+strings.Join(strings.Fields(impostor)[:2], " ")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("ssh", "-F", userCfg, "-o", "BatchMode=yes", "tandem-box", "true").CombinedOutput(); err == nil ||
		!strings.Contains(string(out), "HOST IDENTIFICATION HAS CHANGED") && !strings.Contains(string(out), "Host key verification failed") {
		t.Fatalf("a wrong pinned key was accepted: %v %s", err, out)
	}
	_ = os.WriteFile(pins[0], good, 0o600)
	// Completion offers the task by name.
	comp, compOut, _ := tandemIn(t, dir, nil, "logs", "--shim", shim, "--generate-bash-completion")
	if err := comp.Run(); err != nil || !strings.Contains(compOut.String(), "box") {
		t.Fatalf("completion: %v %q", err, compOut)
	}
	for _, shell := range []string{"bash", "zsh", "fish"} {
		comp, compOut, _ := tandemIn(t, dir, nil, "completion", shell)
		if err := comp.Run(); err != nil || !strings.Contains(compOut.String(), "tandem") {
			t.Fatalf("completion %s: %v %q", shell, err, compOut)
		}
		if shell == "bash" {
			check := exec.Command("bash", "-n")
			check.Stdin = bytes.NewReader(compOut.Bytes())
			if out, err := check.CombinedOutput(); err != nil {
				t.Fatalf("bash completion does not parse: %v %s", err, out)
			}
		}
	}
	rm, _, rmErr := tandemIn(t, dir, nil, "rm", "-f", "--shim", shim, "box")
	if err := rm.Run(); err != nil {
		t.Fatalf("rm: %v %s", err, rmErr)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "tandem_ssh_config")); strings.Contains(string(b), "Host tandem-box") {
		t.Fatalf("entry left after rm:\n%s", b)
	}
	if pins, _ := filepath.Glob(filepath.Join(dir, "known_hosts.d", "*")); len(pins) != 0 {
		t.Fatalf("pin files left after rm: %v", pins)
	}
}

// TestTandemDockerHabits: run takes IMAGE COMMAND as docker run does;
// --gpus all on a host without GPUs is refused before anything runs; a
// server that is not a shim is named in one line, its page not dumped.
func TestTandemDockerHabits(t *testing.T) {
	h, shim, _ := realStack(t)
	dir := t.TempDir()
	run, out, errb := tandemIn(t, dir, nil, "run", "--rm", "--no-ssh-config", "--shim", shim, h.image, "/bin/sh", "-c", "echo hi-from-the-image; cat /bin/busybox >/dev/null")
	if err := run.Run(); err != nil || !strings.Contains(out.String(), "hi-from-the-image") {
		t.Fatalf("run IMAGE COMMAND: %v %s %s", err, out, errb)
	}
	run, out, errb = tandemIn(t, dir, nil, "run", "--no-ssh-config", "--gpus", "all", "--shim", shim, h.image, "true")
	if err := run.Run(); exitCodeOf(err) != 125 || !strings.Contains(errb.String(), "no GPUs") {
		t.Fatalf("--gpus all without GPUs: %v %s %s", err, out, errb)
	}
	if items, err := h.client.ListTasks(context.Background()); err != nil || len(items) != 0 {
		t.Fatalf("tasks left (the attached run removes its own; the refused one makes none): %+v %v", items, err)
	}
	// --pids-limit reaches the task's container.
	run, out, errb = tandemIn(t, dir, nil, "run", "-d", "--no-ssh-config", "--pids-limit", "100", "--name", "pl", "--shim", shim, h.image, "sleep", "60")
	if err := run.Run(); err != nil {
		t.Fatalf("run --pids-limit: %v %s %s", err, out, errb)
	}
	plID := strings.Fields(out.String())[1]
	if got, err := testenv.Docker(context.Background(), "inspect", "-f", "{{.HostConfig.PidsLimit}}", task.ContainerName("pl", plID)); err != nil || strings.TrimSpace(got) != "100" {
		t.Fatalf("the task's pids limit: %q %v", got, err)
	}
	if rm, _, rmErr := tandemIn(t, dir, nil, "rm", "-f", "--shim", shim, "pl"); rm.Run() != nil {
		t.Fatalf("rm: %s", rmErr)
	}
	web := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		w.WriteHeader(http.StatusNotFound)
		_, _ = io.WriteString(w, "<html>\n<body>\n<h1>404 Not Found</h1>\n</body>\n</html>\n")
	}))
	defer web.Close()
	ps, psOut, psErr := tandemIn(t, dir, nil, "ps", "--shim", strings.TrimPrefix(web.URL, "http://"))
	// One line of error (the page is not printed), and one of what to
	// check.
	if err := ps.Run(); exitCodeOf(err) != 125 || strings.Contains(psErr.String(), "<html") || strings.Count(strings.TrimSpace(psErr.String()), "\n") != 1 ||
		!strings.Contains(psErr.String(), "not a dstack agent") || !strings.Contains(psErr.String(), "\nthe server there keeps no tasks: not a dstack-shim") {
		t.Fatalf("ps against a web server: %v %q %q", err, psOut, psErr)
	}
}
