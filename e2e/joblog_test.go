package e2e

import (
	"bytes"
	"context"
	"errors"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/ctl"
	"github.com/tandem-run/tandem/e2e/testenv"
	"github.com/tandem-run/tandem/internal/diskfill"
	"github.com/tandem-run/tandem/internal/loopdev"
	"github.com/tandem-run/tandem/shim/task"
	"golang.org/x/sys/unix"
)

// smallShimHome is a 128 MiB ext4 filesystem on a loop device, the shim
// home of the report.
func smallShimHome(t *testing.T) string {
	t.Helper()
	dev := loopdev.New(t, 128, false)
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", dev).CombinedOutput(); err != nil {
		t.Fatalf("mkfs: %v %s", err, out)
	}
	mnt := t.TempDir()
	if out, err := exec.Command("mount", dev, mnt).CombinedOutput(); err != nil {
		t.Fatalf("mount: %v %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("umount", "-l", mnt).Run() })
	testenv.UnmountUnder(t, mnt)
	return mnt
}

func freeBytes(t *testing.T, path string) int64 {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		t.Fatal(err)
	}
	return int64(st.Bavail) * int64(st.Bsize)
}

func allocated(t *testing.T, path string) int64 {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Sys().(*syscall.Stat_t).Blocks * 512
}

// fillTo writes a file until path's filesystem has about free bytes left.
func fillTo(t *testing.T, file string, free int64) {
	t.Helper()
	f, err := os.Create(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 1<<20)
	for freeBytes(t, filepath.Dir(file)) > free+int64(len(buf)) {
		if _, err := f.Write(buf); err != nil {
			t.Fatal(err)
		}
	}
	_ = f.Sync()
}

// TestJobLogsBoundedOnDisk (issue 25, item 3): on a 128 MiB shim home,
// 200 MiB of escape sequences leave at most the raw log's cap on disk and
// the job ends normally; escape-only output is charged to the hourly
// quota; below the free-space floor output stops being kept (the job goes
// on, and its log says so) and is kept again once space is back. The
// control: a job's ordinary output below the cap arrives whole, through
// both the pull API and the WebSocket stream.
func TestJobLogsBoundedOnDisk(t *testing.T) {
	home := smallShimHome(t)
	bins := testenv.Binaries(t)
	_, runnerPort, _ := net.SplitHostPort(testenv.FreeAddr(t))
	_, sshPort, _ := net.SplitHostPort(testenv.FreeAddr(t))
	// Plain runner dirs: the logs' bounds on the home's own disk. Its five
	// tasks, never removed, would not all fit in bounded dirs on 128 MiB
	// (what those may hold never passes the home's room: issue 64).
	h := startShim(t, bins.Runner, nil, "--shim-home", home, "--runner-http-port", runnerPort, "--runner-ssh-port", sshPort,
		"--runner-dir-size", "0")
	h.home = home
	logPath := func(info api.TaskInfoResponse) string {
		return filepath.Join(home, "runners", info.ContainerName, "job.log")
	}

	// Control: 2 MiB of numbered lines arrive whole.
	info, r, _ := bridgeRunner(t, h, runnerPort)
	r.start(job("/bin/sh", "-c", `i=0; while [ $i -lt 20000 ]; do echo "line $i of the ordinary output pad pad pad pad pad pad pad pad pad"; i=$((i+1)); done; echo END`))
	ctl := r.pullUntilDone(2*time.Minute, nil)
	pulled := ctl.logs.String()
	if n := strings.Count(pulled, " of the ordinary output "); n != 20000 || !strings.Contains(pulled, "line 19999 of") || !strings.Contains(pulled, "END") {
		t.Fatalf("control: pulled %d of 20000 lines; states %+v; runner log %q", n, ctl.states, tailStr(ctl.runner.String(), 800))
	}
	if ws := readAllWS(t, r, time.Time{}); strings.Count(ws, " of the ordinary output ") != 20000 || strings.Contains(ws, "[tandem:") {
		t.Fatalf("control: the stream lost lines or was trimmed (%d bytes)", len(ws))
	}
	t.Logf("FIGURE ordinary job: %d bytes of job.log on disk", allocated(t, logPath(info)))

	// 200 MiB of \033[0m: the raw log keeps its cap, the job ends well.
	info, r, _ = bridgeRunner(t, h, runnerPort)
	r.start(job("/bin/sh", "-c", `yes "$(printf '\033[0m\033[0m\033[0m\033[0m\033[0m\033[0m\033[0m\033[0m')" | head -c 209715200; echo; echo ESCAPES-DONE`))
	res := r.pullUntilDone(5*time.Minute, nil)
	if st := res.final(); st.State != api.JobDone {
		t.Fatalf("escape job: %+v", st)
	}
	onDisk := allocated(t, logPath(info))
	t.Logf("FIGURE 200 MiB of escapes: job.log %d bytes on disk (cap %d); shim home free %d", onDisk, 32<<20, freeBytes(t, home))
	if onDisk > 34<<20 {
		t.Fatalf("job.log holds %d bytes on disk", onDisk)
	}
	if ws := readAllWS(t, r, time.Time{}); !strings.Contains(ws, "bytes of output were dropped here") || !strings.Contains(ws, "ESCAPES-DONE") {
		t.Fatalf("the stream does not say what was dropped or lost the end (%d bytes)", len(ws))
	}

	// Escape-only output is charged to the quota.
	_, r, _ = bridgeRunner(t, h, runnerPort)
	b := job("/bin/sh", "-c", `yes "$(printf '\033[0m\033[0m\033[0m\033[0m')" | head -c 52428800; echo NOT-REACHED`)
	b.LogQuotaHour = 8 << 20
	r.start(b)
	if st := r.pullUntilDone(2*time.Minute, nil).final(); st.State != api.JobFailed || st.TerminationReason != api.ReasonLogQuotaExceeded {
		t.Fatalf("escape-only output past the quota: %+v", st)
	}

	// Below the floor (a tenth of 128 MiB) output is not kept; the job
	// goes on and its log says so; records are still written.
	_, r, _ = bridgeRunner(t, h, runnerPort)
	filler := filepath.Join(home, "other-tenant.fill")
	fillTo(t, filler, 6<<20)
	freeAtStop := freeBytes(t, home)
	r.start(job("/bin/sh", "-c", `i=0; while [ $i -lt 80 ]; do echo "tick $i"; i=$((i+1)); sleep 0.1; done; echo FLOOR-DONE`))
	time.Sleep(2500 * time.Millisecond)
	// A submit on the nearly full home is still saved.
	extra := h.submit(api.TaskConfig{NetworkMode: "bridge"})
	if _, err := os.Stat(filepath.Join(home, "tasks", extra.ID+".json")); err != nil {
		t.Fatalf("a record on the nearly full home: %v", err)
	}
	_ = os.Remove(filler)
	res = r.pullUntilDone(time.Minute, nil)
	out := res.logs.String()
	if st := res.final(); st.State != api.JobDone {
		t.Fatalf("the job must go on below the floor: %+v", st)
	}
	if !strings.Contains(out, "output is not kept until space is freed") || !strings.Contains(out, "output is kept again") ||
		!strings.Contains(out, "FLOOR-DONE") || strings.Count(out, "tick ") >= 80 {
		t.Fatalf("job log across the floor: %q", out)
	}
	t.Logf("FIGURE floor: logging stopped with %d bytes free (floor %d); %d of 80 lines kept", freeAtStop, (128<<20)/10, strings.Count(out, "tick "))
	runnerLog := res.runner.String()
	if !strings.Contains(runnerLog, "no longer kept") {
		t.Errorf("no runner log line for the stop: %q", tailStr(runnerLog, 400))
	}
}

// TestSubmitOnFullShimHome (issue 25, item 4): a job's neighbour fills
// the shim home. A terminate's reason still reaches the disk (the shim
// gives back its reserve for it), so a shim killed and restarted reports
// the same reason. Once even the reserve is used, a submit answers 507 with
// the reason and starts nothing; once space is back a submit works (the
// control).
func TestSubmitOnFullShimHome(t *testing.T) {
	home := smallShimHome(t)
	p := newShimProc(t, runnerScript(t, "sleep 300"))
	p.home = home
	p.start()
	ctx := context.Background()
	img := testenv.Busybox(t)
	cfg := func(prefix string) api.TaskConfig {
		return api.TaskConfig{ID: randomID(prefix), Name: "rs-" + strings.ToLower(randomID("f")), ImageName: img}
	}
	a := cfg("a")
	if err := p.client.SubmitTask(ctx, a); err != nil {
		t.Fatal(err)
	}
	p.waitStatus(a.ID, running)
	reserve := filepath.Join(home, ".state-reserve")
	if fi, err := os.Stat(reserve); err != nil || fi.Size() == 0 {
		t.Fatalf("no state reserve: %v", err)
	}
	diskfill.Full(t, filepath.Join(home, "runners", "tenant-1.fill"))
	t.Logf("FIGURE full home: %d bytes free", freeBytes(t, home))

	if _, err := p.client.TerminateTask(ctx, a.ID, api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByServer, TerminationMessage: "by the server"}); err != nil {
		t.Fatal(err)
	}
	p.waitStatus(a.ID, terminated)
	time.Sleep(300 * time.Millisecond) // the terminal record's write
	if _, err := os.Stat(reserve); !os.IsNotExist(err) {
		t.Fatalf("the reserve was not given back for the record: %v", err)
	}

	// Now nothing is left, not even the reserve: the new task's runner
	// dir has no room, which is checked before its record is written.
	diskfill.Full(t, filepath.Join(home, "runners", "tenant-2.fill"))
	b := cfg("b")
	err := p.client.SubmitTask(ctx, b)
	var se *api.StatusError
	if !errors.As(err, &se) || se.Code != http.StatusInsufficientStorage || !strings.Contains(se.Message, "no room on the shim home's disk") {
		t.Fatalf("submit on a full home: %v", err)
	}
	if containerExists(t, task.ContainerName(b.Name, b.ID)) {
		t.Fatal("a refused submit started a container")
	}
	// tandem says so at once and exits 125: a full home is not a shim
	// that will answer if asked again (it retried for two minutes).
	cmd, _, errb := tandem(t, "run", "--shim", "127.0.0.1:"+p.port, "--no-ssh-config", "--image", img, "--", "true")
	if code := exitCodeOf(cmd.Run()); code != ctl.ExitFailure || !strings.Contains(errb.String(), "free space in its home") ||
		strings.Contains(errb.String(), "tried") {
		t.Fatalf("tandem run on a full home: exit %d: %s", code, errb)
	}

	p.kill9()
	_ = os.Remove(filepath.Join(home, "runners", "tenant-1.fill"))
	_ = os.Remove(filepath.Join(home, "runners", "tenant-2.fill"))
	p.start()
	if got := p.waitStatus(a.ID, terminated); got.TerminationReason != api.ReasonTerminatedByServer || got.TerminationMessage != "by the server" {
		t.Fatalf("after a restart: %+v", got)
	}
	if _, err := p.client.GetTask(ctx, b.ID); !errors.Is(err, api.ErrNotFound) {
		t.Fatalf("the refused task: %v", err)
	}
	c := cfg("c")
	if err := p.client.SubmitTask(ctx, c); err != nil {
		t.Fatalf("control: %v", err)
	}
	p.waitStatus(c.ID, running)
	if fi, err := os.Stat(reserve); err != nil || fi.Size() == 0 {
		t.Fatalf("the reserve was not taken again once space came back: %v", err)
	}
}

// TestRunnerDirBoundedPerTask (issue 39, item 2): a job writing without
// end into its runner dir (/tmp/runner, which the shim reads) meets ENOSPC
// at the dir's own size, a filesystem of its own, while the 128 MiB shim
// home keeps its room: another tenant's submit runs. After the container
// is gone the shim still reads the job's final state and its kept log;
// removing the task takes the filesystem with it.
func TestRunnerDirBoundedPerTask(t *testing.T) {
	home := smallShimHome(t)
	bins := testenv.Binaries(t)
	_, runnerPort, _ := net.SplitHostPort(testenv.FreeAddr(t))
	_, sshPort, _ := net.SplitHostPort(testenv.FreeAddr(t))
	h := startShim(t, bins.Runner, nil, "--shim-home", home, "--runner-http-port", runnerPort, "--runner-ssh-port", sshPort,
		"--runner-dir-size", strconv.Itoa(48<<20))
	info, r, _ := bridgeRunner(t, h, runnerPort)
	dir := filepath.Join(home, "runners", info.ContainerName)
	freeBefore := freeBytes(t, home)
	// Its own space full, its output is not kept either (the runner's
	// floor, on its filesystem); once the job frees it, it is again.
	r.start(job("/bin/sh", "-c", `dd if=/dev/zero of=/tmp/runner/fill bs=1M count=1000 2>/tmp/dd.err; s=$?; n=$(grep -c "No space left on device" /tmp/dd.err); sleep 1.5; rm -f /tmp/runner/fill; sleep 1.5; echo "dd status $s enospc $n"; echo FILL-DONE`))
	lowest := lowestFree(home, freeBefore)
	res := r.pullUntilDone(2*time.Minute, nil)
	freeAtFull := lowest()
	out := res.logs.String()
	if st := res.final(); st.State != api.JobDone || !strings.Contains(out, "dd status 1 enospc 1") || !strings.Contains(out, "FILL-DONE") {
		t.Fatalf("the job did not meet ENOSPC in its own space: %+v %q", st, tailStr(out, 600))
	}
	used := freeBefore - freeAtFull
	t.Logf("FIGURE runner dir of 48 MiB filled: the shim home lost %d bytes (of %d free)", used, freeBefore)
	if used > 56<<20 {
		t.Fatalf("the job took %d bytes of the shim home, over its 48 MiB", used)
	}
	// Another tenant's submit runs.
	other := h.submit(api.TaskConfig{Name: "other"})
	if got := h.wait(other.ID, time.Minute, func(i api.TaskInfoResponse) bool {
		return i.Status != api.TaskPending && i.Status != api.TaskPreparing && i.Status != api.TaskPulling && i.Status != api.TaskCreating
	}); got.Status != api.TaskRunning {
		t.Fatalf("another tenant's task: %+v", got)
	}
	// The container gone, the shim reads the job's end and kept log.
	done := h.wait(info.ID, time.Minute, terminated)
	if done.Tandem == nil || done.Tandem.Job == nil || done.Tandem.Job.State != api.JobDone {
		t.Fatalf("the job's final state after its container: %+v", done.Tandem)
	}
	var kept bytes.Buffer
	if err := h.client.JobLog(context.Background(), info.ID, &kept); err != nil || !strings.Contains(kept.String(), "FILL-DONE") {
		t.Fatalf("kept log: %v %q", err, tailStr(kept.String(), 300))
	}
	if err := h.client.RemoveTask(context.Background(), info.ID); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{dir, dir + ".ext4"} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Fatalf("%s outlived its task: %v", p, err)
		}
	}
}
