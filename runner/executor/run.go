package executor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/atomicfile"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/runner/account"
	"github.com/tandem-run/tandem/runner/logs"
	"github.com/tandem-run/tandem/runner/ptyio"
	"github.com/tandem-run/tandem/runner/ptyproc"
	"github.com/tandem-run/tandem/runner/repo"
)

// Run starts the job: it resolves the job user and working dir at once (the
// answer carries them) and runs everything else in the background. ok is
// false when resolution failed; the failure is then a job state.
func (x *Executor) Run() (api.RunResponse, bool, error) {
	x.mu.Lock()
	if err := x.moveLocked(ServeLogs, "run"); err != nil {
		x.mu.Unlock()
		return api.RunResponse{}, false, err
	}
	body := *x.body
	ctx, cancel := context.WithCancel(context.Background())
	x.cancel = cancel
	close(x.started)
	x.mu.Unlock()

	x.runnerLog = x.openRunnerLog()
	x.runnerLog.Info("Logging configured", "log_level", "info")

	fail := func(msg string) (api.RunResponse, bool, error) {
		x.appendState(x.failure(api.ReasonExecutorError, msg, nil))
		x.finish()
		cancel()
		return api.RunResponse{}, false, nil
	}
	user, err := x.cfg.Accounts.Resolve(body.JobSpec.User, x.cfg.SelfUID)
	if err != nil {
		return fail(fmt.Sprintf("Failed to set job user (%v)", err))
	}
	if k := body.JobSpec.SSHKey; k != nil && k.Public != "" && len(body.ClusterInfo.JobIPs) >= 2 && x.cfg.AuthorizeKey != nil {
		if err := x.cfg.AuthorizeKey(k.Public); err != nil {
			return fail(fmt.Sprintf("Failed to authorize the cluster key (%v)", err))
		}
	}
	wd, err := os.Getwd()
	if err != nil {
		wd = "/"
	}
	if body.JobSpec.WorkingDir != nil {
		if wd, err = ExpandPath(*body.JobSpec.WorkingDir, user.Home, ""); err != nil {
			return fail(fmt.Sprintf("Failed to set job working dir (working dir %v)", err))
		}
	}
	go x.job(ctx, body, user, wd)
	return api.RunResponse{WorkingDir: wd, Username: user.Username}, true, nil
}

func (x *Executor) openRunnerLog() *slog.Logger {
	sinks := []io.Writer{x.cfg.Stdout, x.journal.RunnerLogWriter()}
	if f, err := os.OpenFile(filepath.Join(x.cfg.TempDir, "runner.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644); err == nil {
		sinks = append(sinks, f)
	}
	return logging.New(slog.LevelInfo, sinks...)
}

// finish ends the job: state wait_logs_finished, Finished closed. (The
// final state's file for the shim was written as the state was recorded.)
func (x *Executor) finish() {
	if err := x.finalErr.Load(); err != nil {
		x.runnerLog.Warn("could not leave the job's final state for the shim", "err", *err)
	}
	x.mu.Lock()
	_ = x.moveLocked(WaitLogsFinished, "finish") // allowed from every state
	x.endStdinLocked()
	x.mu.Unlock()
	close(x.finished)
}

// FinalFile is where the runner leaves the job's final state in its temp
// dir (api.RunnerFinalFile).
const FinalFile = api.RunnerFinalFile

// failure is the failed state of a job that could not run, logged once
// ("Executor failed", as dstack's runner says): msg is what the server and
// the user read; cause, when set, is logged only.
func (x *Executor) failure(reason api.TerminationReason, msg string, cause error) api.JobStateEvent {
	attrs := []any{"reason", reason, "message", msg}
	if cause != nil {
		attrs = append(attrs, "err", cause)
	}
	x.runnerLog.Error("Executor failed", attrs...)
	return api.JobStateEvent{State: api.JobFailed, TerminationReason: reason, TerminationMessage: msg}
}

// writeFinal leaves the job's final state ev for the shim (atomically),
// before the journal records it (logs.JournalConfig.BeforeFinal). It runs
// under the journal's clock, which the runner's log also takes: it cannot
// log, so a failure is kept for finish to log.
func (x *Executor) writeFinal(ev api.JobStateEvent) {
	b, err := json.Marshal(ev)
	if err == nil {
		err = atomicfile.WriteBytes(filepath.Join(x.cfg.TempDir, FinalFile), b, atomicfile.Options{Perm: 0o644, UID: -1})
	}
	if err != nil {
		x.finalErr.Store(&err)
	}
}

func (x *Executor) job(ctx context.Context, body api.SubmitBody, user account.JobUser, wd string) {
	log := x.runnerLog
	defer x.finish()
	defer func() {
		if r := recover(); r != nil {
			x.appendState(x.failure(api.ReasonExecutorError, "internal error: the runner failed (its log has the cause)", fmt.Errorf("panic: %v", r)))
		}
	}()
	hist, err := logs.OpenHistoryRetained(filepath.Join(x.cfg.TempDir, "job.log"), x.cfg.Now, x.cfg.LogRetention)
	if err != nil {
		x.appendState(x.failure(api.ReasonExecutorError, "internal error: the job's log cannot be written (the runner's log has the cause)", err))
		return
	}
	x.mu.Lock()
	x.history = hist
	close(x.historyReady)
	codeBlob := x.codeBlob
	x.mu.Unlock()
	defer hist.Close()
	log.Info("Run job")
	owner := repo.Owner{UID: -1}
	if x.cfg.CanSetUser {
		owner = repo.Owner{UID: user.UID, GID: user.GID}
	}

	removeCreds, err := writeGitCredentials(body.RepoCredentials, user, x.cfg.CanSetUser)
	if err != nil {
		log.Warn("git credentials not written", "err", err)
	}
	defer removeCreds()

	repoDir, err := x.setupRepo(body, user, wd, codeBlob, owner)
	if err != nil {
		x.appendState(x.failure(api.ReasonContainerExitedWithError, fmt.Sprintf("Failed to set up the repo (%v)", err), nil))
		return
	}
	if err := x.setupFiles(body, user, wd, owner); err != nil {
		x.appendState(x.failure(api.ReasonExecutorError, fmt.Sprintf("Failed to set up files (%v)", err), nil))
		return
	}
	if err := x.setupClusterSSH(body, user); err != nil {
		log.Warn("cluster ssh", "err", err)
	}
	if x.cfg.Connections != nil {
		x.cfg.Connections.Start(x.cfg.Now())
	}
	x.appendState(api.JobStateEvent{State: api.JobRunning})

	runCtx := ctx
	var cancelDeadline context.CancelFunc = func() {}
	if d := body.JobSpec.MaxDuration; d > 0 {
		runCtx, cancelDeadline = context.WithTimeoutCause(ctx, time.Duration(d)*time.Second, errMaxDuration)
	}
	defer cancelDeadline()
	res := x.execute(runCtx, body, user, wd, repoDir, hist)
	x.appendState(res)
	log.Info("Job finished", "state", res.State, "reason", res.TerminationReason)
}

var (
	errMaxDuration = errors.New("max duration exceeded")
	errLogQuota    = errors.New("log quota exceeded")
)

// execute runs the command in a pty until it exits, is stopped, or the
// deadline or log quota hits; it returns the terminal state, recorded only
// after every byte of output was stored.
func (x *Executor) execute(ctx context.Context, body api.SubmitBody, user account.JobUser, wd, repoDir string, hist *logs.History) api.JobStateEvent {
	log := x.runnerLog
	failed := func(err error) api.JobStateEvent {
		return x.failure(api.ReasonExecutorError, err.Error(), nil)
	}
	cmdline := body.JobSpec.Commands
	if len(cmdline) == 0 {
		return failed(errors.New("job has no commands"))
	}
	env, err := x.prepareJob(body, user, wd, repoDir)
	if err != nil {
		return failed(err)
	}
	spec := ptyproc.Spec{Path: cmdline[0], Args: cmdline, Dir: wd, Env: env, TTY: true, Size: x.startSize(), ProcRoot: x.cfg.ProcRoot}
	keys := x.keysFor(body)
	if body.Tandem != nil && keys == nil {
		spec.Stdin = x.stdinFor(body.Tandem.Stdin)
	}
	if x.cfg.CanSetUser {
		spec.Cred = &ptyproc.Cred{UID: user.UID, GID: user.GID, Groups: user.Groups}
	}
	oomBefore := oomKills(x.cfg.CgroupRoot)
	proc, err := ptyproc.Start(spec)
	if err != nil {
		ev := failed(err)
		var se *ptyproc.StartError
		if errors.As(err, &se) {
			ev.ExitStatus = &se.Code
		}
		return ev
	}
	defer proc.Close()
	defer x.attachTerm(proc)() // before the close: no resize reaches a closed terminal
	master := proc.Terminal()
	if keys != nil {
		go typeKeys(keys, master)
	}
	sid := proc.Pid()
	log.Info("Job started", "pid", sid, "user", user.Username, "uid", user.UID, "working_dir", wd)

	x.mu.Lock()
	quota := &logs.Quota{PerHour: body.LogQuotaHour, Start: x.submitAt, Now: x.cfg.Now}
	x.mu.Unlock()
	// The pipe stores raw output for the WebSocket stream and stripped lines
	// for /api/pull, under the quota, while the disk has room.
	guard := &logs.Guard{Path: x.cfg.TempDir, MinFree: x.cfg.LogMinFree, HostPath: x.cfg.HostFS, HostMinFree: x.cfg.HostMinFree, Now: x.cfg.Now, Log: x.runnerLog}
	pipe := x.journal.Pipe(hist, quota, guard)
	readDone := make(chan struct{})
	var cut outputCut
	ptyReader := ptyio.NewReader(master)
	go func() {
		defer close(readDone)
		buf := make([]byte, 32<<10)
		deliver := func(b []byte) { _, _ = pipe.Write(b) }
		for {
			n, err := ptyReader.Read(buf)
			deliver(cut.pass(buf[:n]))
			if err != nil {
				deliver(cut.rest())
				return
			}
		}
	}()
	exited := proc.Exited()

	var cause error
	select {
	case <-exited:
	case <-ctx.Done():
		cause = context.Cause(ctx)
		// What the job wrote so far goes to disk before the stop starts:
		// a stop with no grace (docker stop -t 0) kills the runner as well.
		if err := hist.Flush(); err != nil {
			x.runnerLog.Warn("job log", "err", err)
		}
		x.stopSequence(proc, &cut)
	case <-pipe.QuotaHit():
		cause = errLogQuota
		proc.SignalSession(syscall.SIGKILL)
		<-exited
	}
	// The main process is gone. The hang-up may come any moment now:
	// reads see it from here on.
	ptyReader.Plain()
	x.drain(proc, readDone)
	_ = pipe.Close()

	// A shell's convention (and docker's): 128 + the signal's number.
	code, killedBy := proc.Wait()
	return x.verdict(cause, code, killedBy, oomBefore, body.LogQuotaHour)
}

// verdict is the job's final state: why it was stopped (cause), else how
// its main process ended (an OOM kill told apart by the cgroup's counter).
func (x *Executor) verdict(cause error, code int, killedBy syscall.Signal, oomBefore int64, quotaHour int64) api.JobStateEvent {
	switch {
	case errors.Is(cause, errLogQuota):
		return api.JobStateEvent{State: api.JobFailed, TerminationReason: api.ReasonLogQuotaExceeded,
			TerminationMessage: fmt.Sprintf("Job log output exceeded the hourly quota of %d bytes", quotaHour)}
	case errors.Is(cause, errMaxDuration):
		return api.JobStateEvent{State: api.JobTerminated, TerminationReason: api.ReasonMaxDurationExceeded, TerminationMessage: "Max duration exceeded"}
	case cause != nil:
		return api.JobStateEvent{State: api.JobTerminated}
	case code == 0:
		return api.JobStateEvent{State: api.JobDone, ExitStatus: &code}
	case (killedBy == syscall.SIGKILL || code == 128+int(syscall.SIGKILL)) && oomKills(x.cfg.CgroupRoot) > oomBefore:
		// Killed by the kernel at the memory limit: the main process, or a
		// child whose status a shell passed on (137).
		return api.JobStateEvent{State: api.JobFailed, ExitStatus: &code,
			TerminationMessage: "out of memory: the kernel killed the job at the container's memory limit (OOM)"}
	case killedBy != 0:
		return api.JobStateEvent{State: api.JobFailed, ExitStatus: &code, TerminationMessage: "killed by signal " + unix.SignalName(killedBy)}
	}
	return api.JobStateEvent{State: api.JobFailed, ExitStatus: &code}
}

// oomKills reads the container cgroup's OOM-kill counter: memory.events
// (cgroup v2) or memory/memory.oom_control (v1); -1 when neither says.
func oomKills(root string) int64 {
	if root == "" {
		return -1
	}
	for _, f := range []string{filepath.Join(root, "memory.events"), filepath.Join(root, "memory", "memory.oom_control")} {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "oom_kill "); ok {
				if n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64); err == nil {
					return n
				}
			}
		}
	}
	return -1
}
