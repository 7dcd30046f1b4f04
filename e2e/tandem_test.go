package e2e

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/md5"
	crand "crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/ctl"
	"github.com/tandem-run/tandem/e2e/testenv"
)

// realStack starts dstack-shim with the real dstack-runner and returns the
// shim and runner ports for tandem.
func realStack(t *testing.T) (h *shimHarness, shimAddr, runnerPort string) {
	t.Helper()
	h, shimAddr, runnerPort, _ = realStackSSH(t)
	return h, shimAddr, runnerPort
}

// realStackSSH also returns the runner SSH port the shim passes on.
func realStackSSH(t *testing.T) (h *shimHarness, shimAddr, runnerPort, sshPort string) {
	t.Helper()
	bins := testenv.Binaries(t)
	_, runnerPort, _ = net.SplitHostPort(testenv.FreeAddr(t))
	_, sshPort, _ = net.SplitHostPort(testenv.FreeAddr(t))
	h = startShim(t, bins.Runner, nil, "--runner-http-port", runnerPort, "--runner-ssh-port", sshPort)
	// Before the shim goes: no task of a failed test outlives it.
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		items, _ := h.client.ListTasks(ctx)
		for _, it := range items {
			_, _ = h.client.TerminateTask(ctx, it.ID, api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser})
			_ = h.client.RemoveTask(ctx, it.ID)
		}
	})
	return h, strings.TrimPrefix(h.client.BaseURL(), "http://"), runnerPort, sshPort
}

func tandem(t *testing.T, args ...string) (*exec.Cmd, *bytes.Buffer, *bytes.Buffer) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(testenv.Binaries(t).Tandem, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	return cmd, &stdout, &stderr
}

func exitCodeOf(err error) int {
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.ExitCode()
	}
	if err != nil {
		return -1
	}
	return 0
}

func taskContainers(t *testing.T) string {
	t.Helper()
	out, _ := testenv.Docker(context.Background(), "ps", "-a", "--filter", "label=ai.dstack.shim.is-task=true", "--filter", "name=tandem-", "-q")
	return strings.TrimSpace(out)
}

func TestTandemRunExitStatusAndCode(t *testing.T) {
	h, shim, rport := realStack(t)
	code := t.TempDir()
	_ = os.WriteFile(filepath.Join(code, "train.sh"), []byte("echo training from code dir\n"), 0o755)
	cmd, out, errb := tandem(t, "run", "--rm", "--shim", shim, "--runner-port", rport, "--image", h.image, "--code", code,
		"--env", "LR=0.1", "--", "/bin/sh", "-c", "sh train.sh; echo lr=$LR; exit 0")
	if err := cmd.Run(); err != nil {
		t.Fatalf("tandem run: %v\n%s\n%s", err, out, errb)
	}
	if !strings.Contains(out.String(), "training from code dir") || !strings.Contains(out.String(), "lr=0.1") {
		t.Fatalf("output %q", out)
	}
	// A job that reads stdin reads its end, as under docker run without
	// -i (on the terminal it waited forever: here for --max-duration, 124).
	cmd, out, errb = tandem(t, "run", "--rm", "--shim", shim, "--runner-port", rport, "--image", h.image, "--max-duration", "60s",
		"--", "/bin/sh", "-c", "cat; read -r line; echo stdin-ended")
	if err := cmd.Run(); err != nil || !strings.Contains(out.String(), "stdin-ended") {
		t.Fatalf("a job reading stdin: %v\n%s\n%s", err, out, errb)
	}
	// --interactive: the job reads tandem's stdin, every byte, then its
	// end; a job that stops reading ends the run as usual, with no word
	// of the input it left.
	input := make([]byte, 6<<20+5)
	_, _ = crand.Read(input)
	cmd, out, errb = tandem(t, "run", "--rm", "--shim", shim, "--runner-port", rport, "--image", h.image, "--interactive", "--max-duration", "60s",
		"--", "/bin/sh", "-c", "md5sum; wc -c")
	cmd.Stdin = bytes.NewReader(input)
	if err := cmd.Run(); err != nil || !strings.Contains(out.String(), fmt.Sprintf("%x", md5.Sum(input))) {
		t.Fatalf("--interactive: %v (want md5 %x)\n%s\n%s", err, md5.Sum(input), out, errb)
	}
	cmd, out, errb = tandem(t, "run", "--rm", "--shim", shim, "--runner-port", rport, "--image", h.image, "--interactive", "--max-duration", "60s",
		"--", "/bin/sh", "-c", "head -c 5 >/dev/null; echo read-enough")
	cmd.Stdin = endless{}
	if err := cmd.Run(); err != nil || !strings.Contains(out.String(), "read-enough") || strings.Contains(errb.String(), "input was cut") {
		t.Fatalf("--interactive, a job that stops reading: %v\n%s\n%s", err, out, errb)
	}
	cmd, out, errb = tandem(t, "run", "--rm", "--shim", shim, "--runner-port", rport, "--image", h.image, "--", "/bin/sh", "-c", "echo failing; exit 7")
	err := cmd.Run()
	if exitCodeOf(err) != 7 || !strings.Contains(errb.String(), "exit status 7") {
		t.Fatalf("exit status must propagate: %v\n%s\n%s", err, out, errb)
	}
	cmd, out, errb = tandem(t, "run", "--rm", "--shim", shim, "--runner-port", rport, "--image", h.image, "-o", "json", "--", "/bin/sh", "-c", "exit 3")
	err = cmd.Run()
	var res struct {
		TaskID     string `json:"task_id"`
		State      string `json:"state"`
		ExitStatus *int   `json:"exit_status"`
		ExitCode   int    `json:"exit_code"`
	}
	if exitCodeOf(err) != 3 || json.Unmarshal(out.Bytes(), &res) != nil || res.State != "failed" || res.ExitStatus == nil || *res.ExitStatus != 3 || res.ExitCode != 3 || res.TaskID == "" {
		t.Fatalf("json output: %v %q %s", err, out, errb)
	}
	cmd, out, _ = tandem(t, "info", "--shim", shim, "-o", "json")
	var info map[string]any
	if err := cmd.Run(); err != nil || json.Unmarshal(out.Bytes(), &info) != nil || info["service"] != "dstack-shim" {
		t.Fatalf("info json: %v %q", err, out)
	}
	// Bad input: unknown image, unreachable shim, no image (no command
	// is the image's own: TestTandemRunImagesOwnCommand).
	cmd, _, errb = tandem(t, "run", "--rm", "--shim", shim, "--runner-port", rport, "--image", "no-such-image:v1", "--", "true")
	if err := cmd.Run(); exitCodeOf(err) != 125 || !strings.Contains(errb.String(), "pullImage error") {
		t.Fatalf("unknown image: %v %s", err, errb)
	}
	cmd, _, errb = tandem(t, "run", "--shim", "127.0.0.1:1", "--", "true")
	if err := cmd.Run(); exitCodeOf(err) != 125 || !strings.Contains(errb.String(), "not reachable") {
		t.Fatalf("unreachable shim: %v %s", err, errb)
	}
	cmd, _, errb = tandem(t, "run", "--shim", shim)
	if err := cmd.Run(); exitCodeOf(err) != 125 || !strings.Contains(errb.String(), "no image: tandem run [flags] IMAGE [COMMAND [ARGS...]]") {
		t.Fatalf("no image: %v %s", err, errb)
	}
	if left := taskContainers(t); left != "" {
		t.Fatalf("containers left behind: %s", left)
	}
}

// TestTandemRunShowsEveryByteAtTheJobsPace: a job prints 48 MB, more than
// the runner keeps of a job's log (32 MiB), while tandem run watches it.
// tandem reads the output from the stream and pulls only the job's states,
// so the runner never holds the job for its journal (held, the job ran at
// one 1 MiB page per poll: 2 MiB/s). Every byte arrives, in order, with no
// "dropped" marker, and the run ends with the job's own status.
func TestTandemRunShowsEveryByteAtTheJobsPace(t *testing.T) {
	h, shim, rport := realStack(t)
	const size = 48_000_000
	gen := "yes 0123456789abcdefghijklmnopqrstuvwxyz | head -c " + strconv.Itoa(size)
	cmd, out, errb := tandem(t, "run", "--rm", "--shim", shim, "--runner-port", rport, "--image", h.image, "--no-ssh-config",
		"--", "/bin/sh", "-c", gen+" > /tmp/out && cat /tmp/out")
	if err := cmd.Run(); err != nil {
		t.Fatalf("tandem run: %v\n%s", err, tailStr(errb.String(), 800))
	}
	want := bytes.Repeat([]byte("0123456789abcdefghijklmnopqrstuvwxyz\n"), size/37+1)[:size]
	if got := out.Bytes(); !bytes.Equal(got, want) {
		i := 0
		for i < min(len(got), len(want)) && got[i] == want[i] {
			i++
		}
		t.Fatalf("output differs from byte %d (%d of %d bytes): %q", i, len(got), size, tailStr(string(got[i:min(len(got), i+200)]), 200))
	}
	if !strings.Contains(errb.String(), "job done") {
		t.Fatalf("the run's end: %s", tailStr(errb.String(), 400))
	}
}

// TestTandemRunImageWithoutPasswd: an image with no /etc/passwd (FROM
// scratch, distroless) runs, as root. The shim names the user uid 0 to
// Docker: told "root", Docker refused to start it ("unable to find user
// root: no matching entries in passwd file").
func TestTandemRunImageWithoutPasswd(t *testing.T) {
	h, shim, rport := realStack(t)
	tag := buildImage(t, "nopasswd", map[string][]byte{"Dockerfile": []byte("FROM " + h.image + "\nRUN rm /etc/passwd /etc/group\n")})
	cmd, out, errb := tandem(t, "run", "--rm", "--shim", shim, "--runner-port", rport, "--image", tag, "--no-ssh-config",
		"--", "/bin/sh", "-c", "test -e /etc/passwd && echo has-passwd; echo uid=$(id -u)")
	if err := cmd.Run(); err != nil || strings.TrimSpace(out.String()) != "uid=0" {
		t.Fatalf("tandem run: %v: %q\n%s", err, out, tailStr(errb.String(), 800))
	}
	if strings.Contains(errb.String(), " as \n") {
		t.Fatalf("a user with no name is shown as an empty one: %s", errb)
	}
}

func TestTandemRunCtrlCLeavesNothing(t *testing.T) {
	h, shim, rport := realStack(t)
	cmd, out, errb := tandem(t, "run", "--rm", "--shim", shim, "--runner-port", rport, "--image", h.image, "--",
		"/bin/sh", "-c", "echo begun; while :; do sleep 1; done")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(out.String(), "begun") {
		if time.Now().After(deadline) {
			t.Fatalf("job did not start: %s %s", out, errb)
		}
		time.Sleep(50 * time.Millisecond)
	}
	_ = cmd.Process.Signal(syscall.SIGINT)
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if exitCodeOf(err) == 0 {
			t.Fatalf("an interrupted run must not exit 0: %s", errb)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("tandem did not exit after Ctrl-C")
	}
	if left := taskContainers(t); left != "" {
		t.Fatalf("containers left behind after Ctrl-C: %s", left)
	}
	items, err := h.client.ListTasks(context.Background())
	if err != nil || len(items) != 0 {
		t.Fatalf("tasks left on the shim: %+v %v", items, err)
	}
}

// tandem reaches the shim and the runner through a real OpenSSH server, the
// way the dstack server does; a wrong host key is refused.
func TestTandemOverSSH(t *testing.T) {
	h, shim, rport := realStack(t)
	sshd := testenv.StartSSHD(t)
	cmd, out, errb := tandem(t, "run", "--ssh", sshd.User+"@"+sshd.Addr, "-i", sshd.ClientKey, "--known-hosts", sshd.KnownHosts,
		"--shim", shim, "--runner-port", rport, "--image", h.image, "--", "/bin/sh", "-c", "echo through the tunnel")
	if err := cmd.Run(); err != nil || !strings.Contains(out.String(), "through the tunnel") {
		t.Fatalf("run over ssh: %v\n%s\n%s", err, out, errb)
	}
	// The job's input goes through the tunnel as well.
	cmd, out, errb = tandem(t, "run", "--ssh", sshd.User+"@"+sshd.Addr, "-i", sshd.ClientKey, "--known-hosts", sshd.KnownHosts,
		"--shim", shim, "--runner-port", rport, "--image", h.image, "--interactive", "--max-duration", "60s", "--", "/bin/sh", "-c", "wc -c")
	cmd.Stdin = bytes.NewReader(make([]byte, 3<<20+1))
	if err := cmd.Run(); err != nil || strings.TrimSpace(out.String()) != strconv.Itoa(3<<20+1) {
		t.Fatalf("run --interactive over ssh: %v\n%s\n%s", err, out, errb)
	}
	cmd, out, errb = tandem(t, "info", "--ssh", sshd.User+"@"+sshd.Addr, "-i", sshd.ClientKey, "--known-hosts", sshd.KnownHosts, "--shim", shim)
	if err := cmd.Run(); err != nil || !strings.Contains(out.String(), "dstack-shim 0.21.3 (tandem ") {
		t.Fatalf("info over ssh: %v\n%s\n%s", err, out, errb)
	}
	// tandem ssh through the host as a jump: the known_hosts file and key
	// given to tandem reach the hop (a ProxyCommand), not only the target.
	dir := t.TempDir()
	cmd, out, errb = tandemIn(t, dir, nil, "run", "-d", "--ssh", sshd.User+"@"+sshd.Addr, "-i", sshd.ClientKey, "--known-hosts", sshd.KnownHosts,
		"--shim", shim, "--image", h.image, "--name", "jumped", "--", "sleep", "300")
	if err := cmd.Run(); err != nil {
		t.Fatalf("run -d over ssh: %v\n%s\n%s", err, out, errb)
	}
	cmd, out, errb = tandemIn(t, dir, nil, "ssh", "--ssh", sshd.User+"@"+sshd.Addr, "-i", sshd.ClientKey, "--known-hosts", sshd.KnownHosts,
		"--shim", shim, "jumped", "--", "echo", "via-the-jump")
	cmd.Stdin = nil
	if err := cmd.Run(); err != nil || strings.TrimSpace(out.String()) != "via-the-jump" {
		t.Fatalf("tandem ssh over --ssh with --known-hosts: %v %q %q", err, out, errb)
	}
	// A command's words reach the program as they are (issue 67, item 7:
	// `sh -c 'exit 5'` was joined into `sh -c exit 5` and exited 0); one
	// word alone is a shell line, as ssh reads one; exec is docker exec.
	jump := []string{"--ssh", sshd.User + "@" + sshd.Addr, "-i", sshd.ClientKey, "--known-hosts", sshd.KnownHosts, "--shim", shim}
	for _, c := range []struct {
		args []string
		out  string
		code int
	}{
		{[]string{"ssh", "jumped", "--", "sh", "-c", "exit 5"}, "", 5},
		{[]string{"ssh", "jumped", "--", "echo $((2+3)) done"}, "5 done", 0},
		{[]string{"exec", "jumped", "sh", "-c", `echo "$0|$1"`, "a b", "it's"}, "a b|it's", 0},
		{[]string{"exec", "jumped", "printf", "%s\n", "$HOME"}, "$HOME", 0},
	} {
		cmd, out, errb = tandemIn(t, dir, nil, append(append([]string{c.args[0]}, jump...), c.args[1:]...)...)
		cmd.Stdin = nil
		err := cmd.Run()
		code := 0
		if exit, ok := err.(*exec.ExitError); ok {
			code = exit.ExitCode()
		} else if err != nil {
			t.Fatalf("%q: %v", c.args, err)
		}
		if code != c.code || strings.TrimSpace(out.String()) != c.out {
			t.Fatalf("%q: exit %d %q, want %d %q (stderr %q)", c.args, code, out, c.code, c.out, errb)
		}
	}
	// tandem cp takes the same jump (scp with the hop's ProxyCommand), with
	// the task's host key pinned, both ways.
	up := filepath.Join(t.TempDir(), "up.txt")
	if err := os.WriteFile(up, []byte("over the jump\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	down := filepath.Join(t.TempDir(), "down.txt")
	for _, args := range [][]string{{up, "jumped:/tmp/up.txt"}, {"jumped:/tmp/up.txt", down}} {
		cmd, out, errb = tandemIn(t, dir, nil, append([]string{"cp", "--ssh", sshd.User + "@" + sshd.Addr, "-i", sshd.ClientKey, "--known-hosts", sshd.KnownHosts,
			"--shim", shim}, args...)...)
		cmd.Stdin = nil
		if err := cmd.Run(); err != nil {
			t.Fatalf("tandem cp %q over --ssh: %v %q %q", args, err, out, errb)
		}
	}
	if got, err := os.ReadFile(down); err != nil || string(got) != "over the jump\n" {
		t.Fatalf("tandem cp over --ssh, back: %q %v", got, err)
	}
	cmd, _, errb = tandemIn(t, dir, nil, "rm", "-f", "--ssh", sshd.User+"@"+sshd.Addr, "-i", sshd.ClientKey, "--known-hosts", sshd.KnownHosts, "--shim", shim, "jumped")
	if err := cmd.Run(); err != nil {
		t.Fatalf("rm over ssh: %v %s", err, errb)
	}
	bad := filepath.Join(t.TempDir(), "known_hosts")
	host, port, _ := net.SplitHostPort(sshd.Addr)
	_ = os.WriteFile(bad, []byte("["+host+"]:"+port+" ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl\n"), 0o644)
	cmd, _, errb = tandem(t, "ps", "--ssh", sshd.User+"@"+sshd.Addr, "-i", sshd.ClientKey, "--known-hosts", bad, "--shim", shim)
	if err := cmd.Run(); exitCodeOf(err) != 125 || !strings.Contains(errb.String(), "HOST KEY MISMATCH") ||
		!strings.Contains(errb.String(), "SHA256:") || !strings.Contains(errb.String(), "ssh-keygen -R '["+host+"]:"+port+"'") {
		t.Fatalf("wrong host key: %v %s", err, errb)
	}
	// The host has ed25519, ECDSA and RSA keys: whichever one known_hosts
	// holds (as OpenSSH recorded it, hashed or not), that one is checked.
	for i, line := range append([]string{sshd.HostPub}, sshd.OtherHostPubs...) {
		kh := filepath.Join(t.TempDir(), "known_hosts")
		_ = os.WriteFile(kh, []byte("["+host+"]:"+port+" "+line+"\n"), 0o644)
		if i == 0 {
			if out, err := exec.Command("ssh-keygen", "-H", "-f", kh).CombinedOutput(); err != nil {
				t.Fatalf("hash known_hosts: %v %s", err, out)
			}
		}
		cmd, _, errb = tandem(t, "ps", "--ssh", sshd.User+"@"+sshd.Addr, "-i", sshd.ClientKey, "--known-hosts", kh, "--shim", shim)
		if err := cmd.Run(); err != nil {
			t.Fatalf("known_hosts with only %s: %v %s", strings.Fields(line)[0], err, errb)
		}
	}
	// A host not on file is unknown, with its fingerprint.
	empty := filepath.Join(t.TempDir(), "known_hosts")
	_ = os.WriteFile(empty, nil, 0o644)
	cmd, _, errb = tandem(t, "ps", "--ssh", sshd.User+"@"+sshd.Addr, "-i", sshd.ClientKey, "--known-hosts", empty, "--shim", shim)
	if err := cmd.Run(); exitCodeOf(err) != 125 || !strings.Contains(errb.String(), "is not in") || !strings.Contains(errb.String(), "SHA256:") {
		t.Fatalf("unknown host: %v %s", err, errb)
	}
	wrongKey := filepath.Join(t.TempDir(), "k")
	_ = exec.Command("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", wrongKey).Run()
	cmd, _, errb = tandem(t, "ps", "--ssh", sshd.User+"@"+sshd.Addr, "-i", wrongKey, "--known-hosts", sshd.KnownHosts, "--shim", shim)
	if err := cmd.Run(); exitCodeOf(err) != 125 || !strings.Contains(errb.String(), "unable to authenticate") {
		t.Fatalf("wrong key: %v %s", err, errb)
	}
}

func TestTandemPsLogsStop(t *testing.T) {
	h, shim, rport := realStack(t)
	run, out, errb := tandem(t, "run", "--rm", "--shim", shim, "--runner-port", rport, "--image", h.image, "--",
		"/bin/sh", "-c", "echo first-line; sleep 1; echo second-line; sleep 300")
	if err := run.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- run.Wait() }()
	var task string
	deadline := time.Now().Add(30 * time.Second)
	for task == "" {
		if time.Now().After(deadline) {
			t.Fatalf("no running task: %s %s", out, errb)
		}
		ps, psOut, _ := tandem(t, "ps", "--shim", shim)
		_ = ps.Run()
		for _, l := range strings.Split(psOut.String(), "\n") {
			if f := strings.Fields(l); len(f) >= 5 && f[3] == "job" && f[4] == "running" {
				task = f[1] // the short id: every command takes a unique prefix
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	for !strings.Contains(out.String(), "second-line") {
		if time.Now().After(deadline) {
			t.Fatalf("job output: %s", out)
		}
		time.Sleep(50 * time.Millisecond)
	}
	// logs prints what there is and exits, as docker logs does; --tail keeps
	// the last lines.
	// The kept output is at most a quarter second behind the job.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		plain, plainOut, plainErr := tandem(t, "logs", "--shim", shim, task)
		err := plain.Run()
		if err == nil && strings.Contains(plainOut.String(), "first-line") && strings.Contains(plainOut.String(), "second-line") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("logs: %v %q %q", err, plainOut, plainErr)
		}
	}
	tail, tailOut, tailErr := tandem(t, "logs", "--tail", "1", "--shim", shim, task)
	if err := tail.Run(); err != nil || strings.Contains(tailOut.String(), "first-line") || !strings.Contains(tailOut.String(), "second-line") {
		t.Fatalf("logs --tail 1: %v %q %q", err, tailOut, tailErr)
	}
	// logs -f streams the history and follows; stop ends the task and the stream.
	logs, logsOut, logsErr := tandem(t, "logs", "-f", "--shim", shim, "--runner-port", rport, task)
	if err := logs.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	stop, stopOut, stopErr := tandem(t, "stop", "--shim", shim, "--timeout", "2", task)
	if err := stop.Run(); err != nil || !strings.Contains(stopOut.String(), "stopped\t") || !strings.Contains(stopOut.String(), "\t"+task) {
		t.Fatalf("stop: %v %s %s", err, stopOut, stopErr)
	}
	_ = logs.Wait()
	if !strings.Contains(logsOut.String(), "first-line") || !strings.Contains(logsOut.String(), "second-line") {
		t.Fatalf("logs: %q %q", logsOut, logsErr)
	}
	select {
	case err := <-done:
		// The shim's word, whichever came first: terminated (stop's
		// terminate), or gone (its remove).
		if exitCodeOf(err) == 0 || !strings.Contains(errb.String(), "was terminated and removed by someone else") &&
			!strings.Contains(errb.String(), "was terminated: terminated_by_user") {
			t.Fatalf("run of a task stopped elsewhere: %v %s", err, errb)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("tandem run did not end after its task was stopped")
	}
	if left := taskContainers(t); left != "" {
		t.Fatalf("containers left: %s", left)
	}
	nolog, _, nologErr := tandem(t, "logs", "--shim", shim, "no-such-task")
	if err := nolog.Run(); exitCodeOf(err) != 125 || !strings.Contains(nologErr.String(), `no such task: "no-such-task"`) {
		t.Fatalf("unknown task: %v %s", err, nologErr)
	}
}

func TestTandemSSHIntoTask(t *testing.T) {
	h, shim, rport, sshPort := realStackSSH(t)
	key := filepath.Join(t.TempDir(), "id")
	if out, err := exec.Command("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key).CombinedOutput(); err != nil {
		t.Fatalf("%v %s", err, out)
	}
	run, out, errb := tandem(t, "run", "--rm", "--shim", shim, "--runner-port", rport, "--image", h.image, "-i", key, "--", "/bin/sh", "-c", "echo up; sleep 300")
	if err := run.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = run.Process.Signal(syscall.SIGINT); _ = run.Wait() }()
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(out.String(), "up") {
		if time.Now().After(deadline) {
			t.Fatalf("job did not start: %s %s", out, errb)
		}
		time.Sleep(50 * time.Millisecond)
	}
	items, err := h.client.ListTasks(context.Background())
	if err != nil || len(items) != 1 {
		t.Fatalf("tasks %+v %v", items, err)
	}
	task := items[0].ID
	ssh, sshOut, sshErr := tandem(t, "ssh", "--shim", shim, "--runner-ssh-port", sshPort, "-i", key, task, "--", "echo $DSTACK_RUN_ID") // one word: a shell line
	if err := ssh.Run(); err != nil || strings.TrimSpace(sshOut.String()) != task {
		t.Fatalf("tandem ssh: %v %q %q", err, sshOut, sshErr)
	}
	// Over --ssh the host becomes OpenSSH's jump host for the container.
	// -J passes no options to the hop, so a key or known_hosts file for it
	// goes through a ProxyCommand.
	jumpClient := func(route ctl.SSHTarget) *ctl.Client {
		c, err := ctl.NewClient(ctl.Config{Shim: shim, Ports: ctl.Ports{SSH: atoi(sshPort)}, SSH: route})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	argv, err := jumpClient(ctl.SSHTarget{Target: "ubuntu@gpu-host:2222"}).SSHCommand(context.Background(), task, ctl.SSHOptions{}, []string{"true"}, false)
	if err != nil || !slices.Contains(argv, "ProxyJump=ubuntu@gpu-host:2222") || argv[len(argv)-1] != "true" {
		t.Fatalf("jump argv: %q %v", argv, err)
	}
	argv, err = jumpClient(ctl.SSHTarget{Target: "ubuntu@gpu-host:2222", Identity: key, KnownHosts: "/k h"}).SSHCommand(context.Background(), task[:6], ctl.SSHOptions{}, []string{"true"}, false)
	want := "ProxyCommand=ssh -o 'UserKnownHostsFile=/k h' -i " + key + " -o IdentitiesOnly=yes -p 2222 -W %h:%p ubuntu@gpu-host"
	if err != nil || !slices.Contains(argv, want) {
		t.Fatalf("jump argv with key and known_hosts: %q %v, want %q", argv, err, want)
	}
	if ssh2, o2, e2 := tandem(t, "ssh", "--shim", shim, "--runner-ssh-port", sshPort, "-i", key, task, "--", "exit", "5"); exitCodeOf(ssh2.Run()) != 5 {
		t.Fatalf("exit status through tandem ssh: %q %q", o2, e2)
	}

	// tandem cp: a file and a directory up to the task and back down,
	// through the runner's SSH server (OpenSSH's scp, over its sftp).
	src, back := t.TempDir(), t.TempDir()
	data := make([]byte, 1<<20)
	_, _ = crand.Read(data)
	if err := os.WriteFile(filepath.Join(src, "data.bin"), data, 0o640); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(src, "tree", "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(src, "tree", "sub", "f.txt"), []byte("nested\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cp := func(args ...string) (int, string) {
		cmd, o, e := tandem(t, append([]string{"cp", "--shim", shim, "--runner-ssh-port", sshPort, "-i", key}, args...)...)
		return exitCodeOf(cmd.Run()), o.String() + e.String()
	}
	for _, args := range [][]string{
		{filepath.Join(src, "data.bin"), task + ":/tmp/up.bin"},
		{filepath.Join(src, "tree"), task + ":/tmp/tree"}, // a directory without -r, as docker cp
		{task + ":/tmp/up.bin", filepath.Join(back, "down.bin")},
		{"-r", task + ":/tmp/tree", filepath.Join(back, "tree")},
	} {
		if code, out := cp(args...); code != 0 {
			t.Fatalf("tandem cp %q: exit %d: %s", args, code, out)
		}
	}
	if got, err := os.ReadFile(filepath.Join(back, "down.bin")); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("the file back from the task differs (%d of %d bytes): %v", len(got), len(data), err)
	}
	if fi, err := os.Stat(filepath.Join(back, "down.bin")); err != nil {
		t.Fatal(err)
	} else if fi.Mode().Perm() != 0o640 {
		t.Fatalf("mode not kept: %v, want -rw-r-----", fi.Mode())
	}
	if got, err := os.ReadFile(filepath.Join(back, "tree", "sub", "f.txt")); err != nil || string(got) != "nested\n" {
		t.Fatalf("the directory back from the task: %q %v", got, err)
	}
	// - is a tar stream, as docker cp reads it: the tree comes out as a tar
	// on stdout, and a tar on stdin goes into a directory (a name with a
	// quote and a space: the remote command is quoted).
	tarOut, stdout, stderr := tandem(t, "cp", "--shim", shim, "--runner-ssh-port", sshPort, "-i", key, task+":/tmp/tree", "-")
	if err := tarOut.Run(); err != nil {
		t.Fatalf("tandem cp TASK:PATH -: %v %s", err, stderr)
	}
	if got := tarMembers(t, stdout.Bytes()); got["tree/sub/f.txt"] != "nested\n" {
		t.Fatalf("tar from the task: %q", got)
	}
	var in bytes.Buffer
	tw := tar.NewWriter(&in)
	_ = tw.WriteHeader(&tar.Header{Name: "it's here/f", Mode: 0o644, Size: 3, Typeflag: tar.TypeReg})
	_, _ = tw.Write([]byte("in\n"))
	_ = tw.Close()
	if _, _, code := outcome(tandem(t, "ssh", "--shim", shim, "--runner-ssh-port", sshPort, "-i", key, task, "--", "mkdir -p '/tmp/a dir'")); code != 0 {
		t.Fatalf("mkdir: %d", code)
	}
	tarIn, _, stderr := tandem(t, "cp", "--shim", shim, "--runner-ssh-port", sshPort, "-i", key, "-", task+":/tmp/a dir")
	tarIn.Stdin = &in
	if err := tarIn.Run(); err != nil {
		t.Fatalf("tandem cp - TASK:DIR: %v %s", err, stderr)
	}
	if out, _, code := outcome(tandem(t, "ssh", "--shim", shim, "--runner-ssh-port", sshPort, "-i", key, task, "--", "cat \"/tmp/a dir/it's here/f\"")); code != 0 || out != "in\n" {
		t.Fatalf("the tar into the task: %d %q", code, out)
	}
	if code, out := cp(filepath.Join(src, "data.bin"), filepath.Join(back, "x")); code == 0 || !strings.Contains(out, "exactly one side") {
		t.Fatalf("two local paths: exit %d: %s", code, out)
	}
	if code, _ := cp(task+":/no/such/file", filepath.Join(back, "y")); code == 0 {
		t.Fatal("a missing file in the task copied without an error")
	}
}

func atoi(s string) int {
	n, _ := strconv.Atoi(s)
	return n
}

// tarMembers reads a tar into name -> content (directories: "").
func tarMembers(t *testing.T, b []byte) map[string]string {
	t.Helper()
	out := map[string]string{}
	tr := tar.NewReader(bytes.NewReader(b))
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatalf("tar: %v (read %q)", err, out)
		}
		c, _ := io.ReadAll(tr)
		out[h.Name] = string(c)
	}
}

// outcome runs cmd (as tandem and tandemIn make it) and returns its
// stdout, stderr and exit code.
func outcome(cmd *exec.Cmd, out, errb *bytes.Buffer) (string, string, int) {
	err := cmd.Run()
	return out.String(), errb.String(), exitCodeOf(err)
}

// endless is an input that never ends.
type endless struct{}

func (endless) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = 'y'
	}
	return len(p), nil
}
