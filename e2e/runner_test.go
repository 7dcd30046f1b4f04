package e2e

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/e2e/testenv"
)

func TestRunnerBusyboxLifecycle(t *testing.T) {
	t.Parallel()
	h := startRunner(t, testenv.Busybox(t))
	ctx := context.Background()
	// Wrong order: run before submit, uploads before submit.
	if _, _, err := h.client.Run(ctx); !errors.Is(err, api.ErrConflict) {
		t.Fatalf("run before submit: %v", err)
	}
	if err := h.client.UploadCode(ctx, strings.NewReader("x")); !errors.Is(err, api.ErrConflict) {
		t.Fatalf("upload before submit: %v", err)
	}
	b := job("/bin/sh", "-c", `echo "hello from $(id -un)"; echo "run=$DSTACK_RUN_NAME job=$DSTACK_JOB_ID spec=$FROM_SPEC home=$HOME"; grep -c export /dstack/profile >/dev/null && echo profile-ok; pwd; exit 3`)
	b.JobSpec.WorkingDir = str("~/work")
	rr := h.start(b)
	if rr.WorkingDir != "/root/work" || rr.Username != "root" {
		t.Fatalf("run answer: %+v", rr)
	}
	if err := h.client.Submit(ctx, b); !errors.Is(err, api.ErrConflict) {
		t.Fatalf("submit after run: %v", err)
	}
	c := h.pullUntilDone(time.Minute, nil)
	if f := c.final(); f.State != api.JobFailed || f.ExitStatus == nil || *f.ExitStatus != 3 {
		t.Fatalf("final %+v", f)
	}
	if c.states[0].State != api.JobRunning {
		t.Fatalf("states %+v", c.states)
	}
	want := "hello from root\nrun=e2e-run job=job-1 spec=yes home=/root\nprofile-ok\n/root/work\n"
	if c.logs.String() != want {
		t.Fatalf("job logs %q want %q", c.logs.String(), want)
	}
	if !strings.Contains(c.runner.String(), "Logging configured") {
		t.Fatalf("runner logs: %q", c.runner.String())
	}
	// A repeated pull after the end is safe and returns nothing new.
	p, err := h.client.Pull(ctx, c.lastTS)
	if err != nil || len(p.JobLogs) != 0 || p.HasMore {
		t.Fatalf("pull after end: %+v %v", p, err)
	}
	if raw, err := os.ReadFile(filepath.Join(h.tempDir, "job.log")); err != nil || !strings.Contains(string(raw), "hello from root\r\n") {
		t.Fatalf("job.log on disk: %q %v", raw, err)
	}
	if ws := readAllWS(t, h, time.Time{}); !strings.Contains(ws, "hello from root\r\n") {
		t.Fatalf("websocket raw stream: %q", ws)
	}
	if code := h.exitCode(30 * time.Second); code != "0" {
		t.Fatalf("runner exit code %s", code)
	}
}

func TestRunnerStopInteractiveBashWithin2s(t *testing.T) {
	t.Parallel()
	h := startRunner(t, testenv.Debian(t))
	h.start(job("/bin/bash", "-i", "-c", `echo started; sleep 100; echo never`))
	var stoppedAt time.Time
	c := h.pullUntilDone(time.Minute, func(c *collected) {
		if stoppedAt.IsZero() && strings.Contains(c.logs.String(), "started") {
			stoppedAt = time.Now()
			if err := h.client.Stop(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
	})
	if took := time.Since(stoppedAt); took > 2*time.Second {
		t.Fatalf("stop took %s", took)
	}
	if f := c.final(); f.State != api.JobTerminated || f.TerminationReason != "" {
		t.Fatalf("final %+v", f)
	}
	if !strings.Contains(c.logs.String(), "started\n") || strings.Contains(c.logs.String(), "never") {
		t.Fatalf("logs %q", c.logs.String())
	}
}

func TestRunnerMaxDurationAndBackgroundLeftovers(t *testing.T) {
	t.Parallel()
	h := startRunner(t, testenv.Busybox(t))
	// The main process ends at once, but a background child keeps the
	// terminal open: the job must still end, and max_duration is not hit.
	b := job("/bin/sh", "-c", `(sleep 300; echo late) & echo main-done`)
	b.JobSpec.MaxDuration = 60
	start := time.Now()
	h.start(b)
	c := h.pullUntilDone(time.Minute, nil)
	if f := c.final(); f.State != api.JobDone || time.Since(start) > 10*time.Second {
		t.Fatalf("final %+v after %s", f, time.Since(start))
	}

	h2 := startRunner(t, testenv.Busybox(t))
	b = job("/bin/sh", "-c", `echo tick; sleep 100`)
	b.JobSpec.MaxDuration = 1
	h2.start(b)
	c = h2.pullUntilDone(time.Minute, nil)
	if f := c.final(); f.State != api.JobTerminated || f.TerminationReason != api.ReasonMaxDurationExceeded || f.TerminationMessage != "Max duration exceeded" {
		t.Fatalf("final %+v", f)
	}
}

// Every line of a big output arrives exactly once and in order, through the
// server's pull loop and through the WebSocket.
func TestRunnerLogsCompleteAndOrdered(t *testing.T) {
	t.Parallel()
	const n = 200000
	h := startRunner(t, testenv.Busybox(t))
	h.start(job("/bin/sh", "-c", fmt.Sprintf("seq 1 %d", n)))
	c := h.pullUntilDone(3*time.Minute, nil)
	if f := c.final(); f.State != api.JobDone {
		t.Fatalf("final %+v", f)
	}
	lines := strings.Split(strings.TrimSuffix(c.logs.String(), "\n"), "\n")
	if len(lines) != n {
		t.Fatalf("%d lines, want %d", len(lines), n)
	}
	for i, l := range lines {
		if l != strconv.Itoa(i+1) {
			t.Fatalf("line %d is %q", i+1, l)
		}
	}
	if c.maxResp > 1<<20+64<<10 {
		t.Fatalf("a pull returned %d bytes of logs; answers must be capped", c.maxResp)
	}
	ws := strings.Split(strings.TrimSuffix(readAllWS(t, h, time.Time{}), "\r\n"), "\r\n")
	if len(ws) != n || ws[n-1] != strconv.Itoa(n) {
		t.Fatalf("websocket: %d lines, last %q", len(ws), ws[len(ws)-1])
	}
}

func TestRunnerNonRootUserCodeAndFiles(t *testing.T) {
	t.Parallel()
	h := startRunner(t, testenv.Busybox(t))
	b := job("/bin/sh", "-c", `id; pwd; cat /workflow/src/app.txt; cat ~/inputs/a.txt; ls -ln /workflow/src/app.txt | awk '{print $3}'`)
	b.JobSpec.User = &api.JobUser{Username: str("user")}
	b.JobSpec.WorkingDir = str("~/w")
	b.JobSpec.FileArchives = []api.FileArchive{{ID: "11111111-2222-4333-8444-555555555555", Path: "~/inputs"}}
	ctx := context.Background()
	if err := h.client.Submit(ctx, b); err != nil {
		t.Fatal(err)
	}
	code := tarOf(t, map[string]string{"src/app.txt": "code v1\n"})
	if err := h.client.UploadCode(ctx, bytes.NewReader(code)); err != nil {
		t.Fatal(err)
	}
	files := tarOf(t, map[string]string{"data/a.txt": "file A\n"})
	if err := h.client.UploadArchive(ctx, "11111111-2222-4333-8444-555555555555", bytes.NewReader(files)); err != nil {
		t.Fatal(err)
	}
	if err := h.client.UploadArchive(ctx, "../escape", bytes.NewReader(files)); !errors.Is(err, api.ErrBadRequest) {
		t.Fatalf("archive id with ..: %v", err)
	}
	rr, ok, err := h.client.Run(ctx)
	if err != nil || !ok || rr.Username != "user" || rr.WorkingDir != "/home/user/w" {
		t.Fatalf("run: %+v %v %v", rr, ok, err)
	}
	c := h.pullUntilDone(time.Minute, nil)
	want := "uid=1000(user) gid=1000(user) groups=100(users),1000(user)\n/home/user/w\ncode v1\nfile A\n1000\n"
	if c.final().State != api.JobDone || c.logs.String() != want {
		t.Fatalf("final %+v logs %q want %q", c.final(), c.logs.String(), want)
	}
}

func TestRunnerTarSlipAndEmptyCommands(t *testing.T) {
	t.Parallel()
	h := startRunner(t, testenv.Busybox(t))
	b := job("/bin/sh", "-c", "echo should-not-run")
	b.JobSpec.FileArchives = []api.FileArchive{{ID: "evil", Path: "/data/in"}}
	ctx := context.Background()
	if err := h.client.Submit(ctx, b); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	_ = tw.WriteHeader(&tar.Header{Name: "in/../../../etc/evil", Mode: 0o644, Size: 1, Typeflag: tar.TypeReg})
	_, _ = tw.Write([]byte("x"))
	_ = tw.Close()
	if err := h.client.UploadArchive(ctx, "evil", &buf); err != nil {
		t.Fatal(err)
	}
	if _, _, err := h.client.Run(ctx); err != nil {
		t.Fatal(err)
	}
	c := h.pullUntilDone(time.Minute, nil)
	if f := c.final(); f.State != api.JobFailed || f.TerminationReason != api.ReasonExecutorError || !strings.Contains(f.TerminationMessage, "Failed to set up files") || !strings.Contains(f.TerminationMessage, "unsafe path") {
		t.Fatalf("final %+v", f)
	}
	if out, _ := testenv.Docker(ctx, "exec", h.container, "ls", "/etc/evil"); strings.Contains(out, "evil") {
		t.Fatal("tar-slip wrote outside the destination")
	}

	h2 := startRunner(t, testenv.Busybox(t))
	h2.start(job())
	c = h2.pullUntilDone(time.Minute, nil)
	if f := c.final(); f.State != api.JobFailed || f.TerminationReason != api.ReasonExecutorError {
		t.Fatalf("empty commands: %+v", f)
	}
}

// A remote repo cloned by the runner in an image with no git binary, from a
// real git daemon, with the client's uncommitted diff applied on top.
func TestRunnerRemoteRepoWithDiff(t *testing.T) {
	t.Parallel()
	src := t.TempDir()
	gitc := func(args ...string) string {
		t.Helper()
		cmd := exec.Command("git", args...)
		cmd.Dir = src
		cmd.Env = append(os.Environ(), "GIT_AUTHOR_NAME=a", "GIT_AUTHOR_EMAIL=a@x", "GIT_COMMITTER_NAME=a", "GIT_COMMITTER_EMAIL=a@x")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("git %v: %v %s", args, err, out)
		}
		return strings.TrimSpace(string(out))
	}
	gitc("init", "-q", "-b", "main")
	_ = os.WriteFile(filepath.Join(src, "train.py"), []byte("print('v1')\n"), 0o644)
	gitc("add", ".")
	gitc("commit", "-q", "-m", "v1")
	hash := gitc("rev-parse", "HEAD")
	_ = os.WriteFile(filepath.Join(src, "train.py"), []byte("print('v2')\n"), 0o644)
	_ = os.WriteFile(filepath.Join(src, "new.txt"), []byte("added\n"), 0o644)
	gitc("add", "-N", "new.txt")
	diff := gitc("diff", "HEAD") + "\n"
	_ = os.WriteFile(filepath.Join(src, ".git", "git-daemon-export-ok"), nil, 0o644)
	addr := testenv.FreeAddr(t)
	host, port, _ := strings.Cut(addr, ":")
	daemon := exec.Command("git", "daemon", "--reuseaddr", "--listen="+host, "--port="+port, "--base-path="+filepath.Dir(src), filepath.Dir(src))
	testenv.StartDaemon(t, daemon) // git daemon forks per client: killed as a group
	time.Sleep(300 * time.Millisecond)

	h := startRunner(t, testenv.Busybox(t))
	b := job("/bin/sh", "-c", "cd /workflow && cat train.py new.txt && ls -a | grep -c .git")
	b.JobSpec.RepoData = &api.RepoData{RepoType: api.RepoRemote, RepoName: "r", RepoBranch: "main", RepoHash: hash}
	b.RepoCredentials = &api.RepoCredentials{CloneURL: "git://" + addr + "/" + filepath.Base(src)}
	ctx := context.Background()
	if err := h.client.Submit(ctx, b); err != nil {
		t.Fatal(err)
	}
	if err := h.client.UploadCode(ctx, strings.NewReader(diff)); err != nil {
		t.Fatal(err)
	}
	if _, _, err := h.client.Run(ctx); err != nil {
		t.Fatal(err)
	}
	c := h.pullUntilDone(time.Minute, nil)
	if f := c.final(); f.State != api.JobDone || c.logs.String() != "print('v2')\nadded\n1\n" {
		t.Fatalf("final %+v logs %q runner %q", f, c.logs.String(), tailStr(c.runner.String(), 600))
	}
}

func tarOf(t *testing.T, files map[string]string) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for name, body := range files {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(body)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		_, _ = tw.Write([]byte(body))
	}
	_ = tw.Close()
	return buf.Bytes()
}

func TestRunnerMetricsAndNoJobExit(t *testing.T) {
	t.Parallel()
	h := startRunner(t, testenv.Busybox(t))
	m, err := h.client.Metrics(context.Background())
	if err != nil || m.MemoryUsageBytes == 0 || m.TimestampMicro == 0 || m.GPUs == nil || len(m.GPUs) != 0 {
		t.Fatalf("metrics from the container's cgroup: %+v %v", m, err)
	}
	// No job within --start-timeout: exit 1.
	bins := testenv.Binaries(t)
	out, err := testenv.Docker(context.Background(), "run", "--rm", "--network", "none", "-v", bins.Runner+":/r:ro", testenv.Busybox(t),
		"sh", "-c", "/r start --temp-dir /tmp/r --http-port 10999 --start-timeout 1s >/dev/null 2>&1; echo exit=$?")
	if err != nil || strings.TrimSpace(out) != "exit=1" {
		t.Fatalf("no job: %q %v", out, err)
	}
}

// A job that ignores Ctrl-C, SIGTERM and SIGHUP is killed after the grace.
func TestRunnerStopEscalatesToKill(t *testing.T) {
	t.Parallel()
	h := startRunner(t, testenv.Busybox(t))
	h.start(job("/bin/sh", "-c", `trap '' INT TERM HUP; echo stubborn; while :; do sleep 1; done`))
	var stoppedAt time.Time
	c := h.pullUntilDone(time.Minute, func(c *collected) {
		if stoppedAt.IsZero() && strings.Contains(c.logs.String(), "stubborn") {
			stoppedAt = time.Now()
			_ = h.client.Stop(context.Background())
		}
	})
	if took := time.Since(stoppedAt); took > 15*time.Second {
		t.Fatalf("escalation took %s", took)
	}
	if f := c.final(); f.State != api.JobTerminated {
		t.Fatalf("final %+v", f)
	}
}

func TestRunnerLogQuota(t *testing.T) {
	t.Parallel()
	h := startRunner(t, testenv.Busybox(t))
	b := job("/bin/sh", "-c", `i=0; while :; do i=$((i+1)); echo "line $i of a job that talks too much"; done`)
	b.LogQuotaHour = 64 << 10
	h.start(b)
	c := h.pullUntilDone(time.Minute, nil)
	f := c.final()
	if f.State != api.JobFailed || f.TerminationReason != api.ReasonLogQuotaExceeded ||
		f.TerminationMessage != "Job log output exceeded the hourly quota of 65536 bytes" {
		t.Fatalf("final %+v", f)
	}
	if n := c.logs.Len(); n > 64<<10 || n == 0 {
		t.Fatalf("stored %d bytes of job logs for a 64 KiB quota", n)
	}
}

// TestRunnerStopInteractiveShEndsAtOnce (issue 17): the dstack server runs
// jobs as `/bin/sh -i -c "..."`. Ctrl-C kills the foreground sleep and the
// interactive shell takes the terminal back; the runner hangs the session
// up right then: the job ends within a second, without a prompt in its
// logs, in busybox's ash and Debian's dash.
func TestRunnerStopInteractiveShEndsAtOnce(t *testing.T) {
	t.Parallel()
	for name, image := range map[string]func(testing.TB) string{"busybox": testenv.Busybox, "debian": testenv.Debian} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			// A 30 s Ctrl-C grace: only the hang-up can end the job early.
			h := startRunnerWith(t, image(t), "--interrupt-grace", "30s")
			h.start(job("/bin/sh", "-i", "-c", `echo before && sleep 300 && echo after`))
			var stoppedAt time.Time
			c := h.pullUntilDone(time.Minute, func(c *collected) {
				if stoppedAt.IsZero() && strings.Contains(c.logs.String(), "before") {
					stoppedAt = time.Now()
					if err := h.client.Stop(context.Background()); err != nil {
						t.Fatal(err)
					}
				}
			})
			took := time.Since(stoppedAt)
			logs := c.logs.String()
			rest := strings.TrimSpace(logs[strings.Index(logs, "before\n")+len("before\n"):])
			t.Logf("%s: stop to terminated in %s; after the output: %q", name, took.Round(time.Millisecond), rest)
			if took > 10*time.Second {
				t.Fatalf("stop took %s: the shell waited at its prompt for the escalation", took)
			}
			if f := c.final(); f.State != api.JobTerminated {
				t.Fatalf("final %+v", f)
			}
			if strings.Contains(logs, "after") || (rest != "" && rest != "^C") {
				t.Fatalf("logs after the stop: %q", logs)
			}
			if out, _ := testenv.Docker(context.Background(), "top", h.container); strings.Contains(out, "sleep 300") {
				t.Fatalf("a process was left: %s", out)
			}
		})
	}
}

// TestRunnerStopGivesSIGINTHandlersTheirGrace: a foreground program that
// handles Ctrl-C itself keeps the terminal while it cleans up; the stop
// waits for it and keeps what it printed.
func TestRunnerStopGivesSIGINTHandlersTheirGrace(t *testing.T) {
	t.Parallel()
	h := startRunnerWith(t, testenv.Busybox(t), "--interrupt-grace", "30s")
	h.start(job("/bin/sh", "-i", "-c", `sh -c 'trap "echo caught; sleep 1; echo cleaned; exit 0" INT; echo ready; while :; do sleep 0.2; done'; echo next`))
	var stoppedAt time.Time
	c := h.pullUntilDone(time.Minute, func(c *collected) {
		if stoppedAt.IsZero() && strings.Contains(c.logs.String(), "ready") {
			stoppedAt = time.Now()
			if err := h.client.Stop(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
	})
	took := time.Since(stoppedAt)
	logs := c.logs.String()
	if !strings.Contains(logs, "cleaned") || took < time.Second || took > 20*time.Second {
		t.Fatalf("after %s, logs %q", took, logs)
	}
}
