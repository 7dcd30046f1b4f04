package e2e

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/tandem-run/tandem/api"
)

// psRowOf is the ps -a line of the task named name ("" when none).
func psRowOf(run func(args ...string) (string, string, int), name string) string {
	out, _, _ := run("ps", "-a")
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, name+" ") {
			return l
		}
	}
	return ""
}

// TestTandemStopKeepsTask (issue 67, items 3 and 8): stop stops a task
// and keeps it, as docker stop: its output, its exit status and its ps -a
// row stay until rm; rm of a running task says to stop it or add -f; rm
// -f stops and removes; a finished foreground run stays in ps -a until
// pruned, unless --rm; logs right after run -d shows what the job printed.
func TestTandemStopKeepsTask(t *testing.T) {
	h, shim, _ := realStack(t)
	run := tandemAt(t, t.TempDir(), shim)
	if out, errOut, code := run("run", "-d", "--no-ssh-config", "--name", "keep-a", h.image, "sh", "-c", "echo early-line; exec sleep 300"); code != 0 {
		t.Fatalf("run -d: %d %s %s", code, out, errOut)
	}
	// Right after run -d: the job's first line, not an empty answer.
	if out, errOut, code := run("logs", "keep-a"); code != 0 || !strings.Contains(out, "early-line") {
		t.Fatalf("logs right after run -d: %d %q %q", code, out, errOut)
	}
	_, errOut, code := run("rm", "keep-a")
	if want := "tandem: task keep-a is running: stop it first (tandem stop), or add -f to stop and remove it (tandem rm -f)\n"; code != 125 || errOut != want {
		t.Fatalf("rm of a running task: %d %q, want %q", code, errOut, want)
	}
	if out, errOut, code := run("stop", "-t", "1", "keep-a"); code != 0 || !strings.HasPrefix(out, "stopped\tkeep-a\t") {
		t.Fatalf("stop: %d %q %q", code, out, errOut)
	}
	if row := psRowOf(run, "keep-a"); row == "" {
		t.Fatal("ps -a after stop: no keep-a row")
	}
	if out, errOut, code := run("logs", "keep-a"); code != 0 || !strings.Contains(out, "early-line") {
		t.Fatalf("logs after stop: %d %q %q", code, out, errOut)
	}
	if out, errOut, code := run("rm", "keep-a"); code != 0 || !strings.HasPrefix(out, "removed\tkeep-a\t") {
		t.Fatalf("rm of a stopped task: %d %q %q", code, out, errOut)
	}
	if row := psRowOf(run, "keep-a"); row != "" {
		t.Fatalf("ps -a after rm: %q", row)
	}

	// rm -f: stopped at once, then removed.
	if _, errOut, code := run("run", "-d", "--no-ssh-config", "--name", "keep-b", h.image, "sleep", "300"); code != 0 {
		t.Fatalf("run -d: %d %s", code, errOut)
	}
	if out, errOut, code := run("rm", "-f", "keep-b"); code != 0 || !strings.HasPrefix(out, "removed\tkeep-b\t") {
		t.Fatalf("rm -f: %d %q %q", code, out, errOut)
	}

	// A finished foreground run is kept, with its exit status and output.
	if out, errOut, code := run("run", "--no-ssh-config", "--name", "fg", h.image, "sh", "-c", "echo fg-out; exit 4"); code != 4 || !strings.Contains(out, "fg-out") {
		t.Fatalf("run: %d %q %q", code, out, errOut)
	}
	if row := psRowOf(run, "fg"); !strings.Contains(row, " 4") {
		t.Fatalf("ps -a of a finished run: %q", row)
	}
	if out, errOut, code := run("logs", "fg"); code != 0 || !strings.Contains(out, "fg-out") {
		t.Fatalf("logs of a finished run: %d %q %q", code, out, errOut)
	}
	// --rm: gone at the end.
	if _, errOut, code := run("run", "--rm", "--no-ssh-config", "--name", "fg-rm", h.image, "true"); code != 0 {
		t.Fatalf("run --rm: %d %q", code, errOut)
	}
	if row := psRowOf(run, "fg-rm"); row != "" {
		t.Fatalf("ps -a after run --rm: %q", row)
	}
	if out, errOut, code := run("prune"); code != 0 || !strings.Contains(out, "removed\tfg\t") {
		t.Fatalf("prune: %d %q %q", code, out, errOut)
	}
	if row := psRowOf(run, "fg"); row != "" {
		t.Fatalf("ps -a after prune: %q", row)
	}
}

// TestTandemManyRunsAtOnce (issue 67, items 1 and 8): on the default
// network (bridge) ten run -d start while the others run; on the host
// network a second one is refused, as before, for the runner's ports.
func TestTandemManyRunsAtOnce(t *testing.T) {
	h, shim, _ := realStack(t)
	run := tandemAt(t, t.TempDir(), shim)
	for i := range 10 {
		name := "many-" + strconv.Itoa(i)
		if out, errOut, code := run("run", "-d", "--no-ssh-config", "--name", name, h.image, "sh", "-c", "echo up-"+name+"; exec sleep 300"); code != 0 || !strings.HasPrefix(out, name+"\t") {
			t.Fatalf("run -d %s while %d run: %d %q %q", name, i, code, out, errOut)
		}
	}
	out, _, _ := run("ps")
	if n := strings.Count(out, "job running"); n != 10 {
		t.Fatalf("ps: %d jobs running, want 10:\n%s", n, out)
	}
	for i := range 10 {
		if out, errOut, code := run("logs", "many-"+strconv.Itoa(i)); code != 0 || !strings.Contains(out, "up-many-"+strconv.Itoa(i)) {
			t.Fatalf("logs many-%d: %d %q %q", i, code, out, errOut)
		}
	}
	args := []string{"rm", "-f"}
	for i := range 10 {
		args = append(args, "many-"+strconv.Itoa(i))
	}
	if _, errOut, code := run(args...); code != 0 {
		t.Fatalf("rm -f: %d %s", code, errOut)
	}
}

// TestTandemDockerFlags (issue 67, items 2, 4, 5 and 8): docker's flags
// where they mean the same, and the exact line a user sees for each
// refusal, before anything is made.
func TestTandemDockerFlags(t *testing.T) {
	h, shim, _ := realStack(t)
	dir := t.TempDir()
	run := tandemAt(t, dir, shim)
	refused := func(want string, args ...string) {
		t.Helper()
		before, _ := h.client.ListTasks(t.Context())
		out, errOut, code := run(args...)
		if code != 125 || errOut != want {
			t.Errorf("%q: %d %q %q, want 125 and %q", args, code, out, errOut, want)
		}
		if after, _ := h.client.ListTasks(t.Context()); len(after) != len(before) {
			t.Errorf("%q made a task", args)
		}
	}
	missing := filepath.Join(dir, "nonexistent")
	refused("tandem: mount "+missing+":/data: "+missing+" does not exist; a mount's host path is never created: make it first (mkdir -p "+missing+")\n",
		"run", "-v", missing+":/data", h.image, "true")
	if _, err := os.Stat(missing); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a refused mount made its host path: %v", err)
	}
	refused("tandem: tandem run has no -P (docker's): tandem publishes only the ports you name: give each with -p HOST_PORT:CONTAINER_PORT\n",
		"run", "-P", h.image, "true")
	refused("tandem: tandem run has no flag --frobnicate (tandem run --help lists them)\n", "run", "--frobnicate", h.image, "true")
	refused("tandem: --cpu -1: want a positive count of cores, e.g. 1.5 (0: no limit)\n", "run", "--cpu", "-1", h.image, "true")
	_, errOut, code := outcome(tandemIn(t, dir, nil, "ps", "--shim", "127.0.0.1:1"))
	if want := "tandem: shim at 127.0.0.1:1 is not reachable (connection refused); is dstack-shim running there?\nstart one (dstack-shim on that host, or tandem host install), or give its address with --shim HOST:PORT (or TANDEM_SHIM)\n"; code != 125 || errOut != want {
		t.Errorf("ps of no shim: %d %q, want %q", code, errOut, want)
	}
	// The shim refuses a missing path itself for a client it cannot see
	// (over --ssh): 400, nothing made.
	err := h.client.SubmitTask(t.Context(), api.TaskConfig{ID: randomID("task"), Name: "must-exist", ImageName: h.image,
		InstanceMounts: []api.InstanceMountPoint{{InstancePath: missing, Path: "/data", MustExist: true}}})
	if err == nil || !strings.Contains(err.Error(), "no such file or directory on the host (it is not created: make it first)") {
		t.Errorf("submit of a missing tandem_must_exist mount: %v", err)
	}
	if _, err := os.Stat(missing); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the shim made a must-exist mount's path: %v", err)
	}

	// -v :ro is read-only, -v without is not; -w, -u, --entrypoint as docker's.
	data := filepath.Join(dir, "data")
	if err := os.Mkdir(data, 0o777); err != nil {
		t.Fatal(err)
	}
	if out, errOut, code := run("run", "--rm", "-q", "--no-ssh-config", "-v", data+":/data:ro", h.image, "sh", "-c", "touch /data/x"); code == 0 {
		t.Errorf("a write to a :ro mount: %d %q %q", code, out, errOut)
	}
	if out, errOut, code := run("run", "--rm", "-q", "--no-ssh-config", "--volume", data+":/data", h.image, "sh", "-c", "echo w > /data/x"); code != 0 {
		t.Errorf("a write to a mount: %d %q %q", code, out, errOut)
	}
	if b, err := os.ReadFile(filepath.Join(data, "x")); err != nil || string(b) != "w\n" {
		t.Errorf("the mount's file: %q %v", b, err)
	}
	if out, errOut, code := run("run", "--rm", "-q", "--no-ssh-config", "-w", "/tmp", "-u", "1000:1000", h.image, "sh", "-c", "echo $(id -u):$(id -g) $(pwd)"); code != 0 || out != "1000:1000 /tmp\n" {
		t.Errorf("-w /tmp -u 1000:1000: %d %q %q", code, out, errOut)
	}
	if out, errOut, code := run("run", "--rm", "-q", "--no-ssh-config", "--entrypoint", "/bin/echo", h.image, "from", "the", "entrypoint"); code != 0 || out != "from the entrypoint\n" {
		t.Errorf("--entrypoint: %d %q %q", code, out, errOut)
	}
	// -q: the job's output and nothing else.
	if out, errOut, code := run("run", "--rm", "-q", "--no-ssh-config", h.image, "echo", "quiet"); code != 0 || out != "quiet\n" || errOut != "" {
		t.Errorf("-q: %d %q %q", code, out, errOut)
	}
	// The old -i KEYFILE still works, said deprecated; -i alone is docker's.
	key := filepath.Join(dir, "id_ed25519")
	if err := os.WriteFile(key, []byte("-----BEGIN OPENSSH PRIVATE KEY-----\nnot used here\n-----END OPENSSH PRIVATE KEY-----\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, errOut, code := run("run", "--rm", "-q", "--no-ssh-config", "-i", key, h.image, "echo", "ok"); code != 0 || out != "ok\n" ||
		errOut != "tandem: warning: -i "+key+" as the SSH key is deprecated (-i is docker's --interactive now): use --identity "+key+"\n" {
		t.Errorf("-i KEYFILE: %d %q %q", code, out, errOut)
	}
	cmd, stdout, stderr := tandemIn(t, dir, nil, "run", "--shim", shim, "--rm", "-q", "--no-ssh-config", "-i", h.image, "sh", "-c", "read l; echo got-$l")
	cmd.Stdin = strings.NewReader("typed\n")
	if err := cmd.Run(); err != nil || stdout.String() != "got-typed\n" {
		t.Errorf("-i: %v %q %q", err, stdout, stderr)
	}
	// --max-duration's stop leaves no ^C in the output.
	if out, errOut, code := run("run", "--rm", "--no-ssh-config", "--max-duration", "2s", h.image, "sh", "-c", "echo before; sleep 30"); code != 124 || strings.Contains(out, "^C") || !strings.Contains(out, "before") {
		t.Errorf("--max-duration: %d %q %q", code, out, errOut)
	}
}
