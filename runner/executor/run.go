package executor

import (
	"bytes"
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
	"sync"
	"syscall"
	"time"

	"github.com/tandem-run/tandem/common/ident"
	"github.com/tandem-run/tandem/runner/ptyproc"

	"golang.org/x/sys/unix"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/atomicfile"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/runner/account"
	"github.com/tandem-run/tandem/runner/logs"
	"github.com/tandem-run/tandem/runner/ptyio"
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
		x.runnerLog.Error("Executor failed", "err", msg)
		x.appendState(api.JobStateEvent{State: api.JobFailed, TerminationReason: api.ReasonExecutorError, TerminationMessage: msg})
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

// finish ends the job: state wait_logs_finished, Finished closed.
func (x *Executor) finish() {
	x.writeFinal()
	x.mu.Lock()
	_ = x.moveLocked(WaitLogsFinished, "finish") // allowed from every state
	x.mu.Unlock()
	close(x.finished)
}

// FinalFile is where the runner leaves the job's final state in its temp
// dir (api.RunnerFinalFile).
const FinalFile = api.RunnerFinalFile

// writeFinal leaves the job's final state for the shim (atomically).
func (x *Executor) writeFinal() {
	ev, ok := x.journal.LastStateEvent()
	if !ok || !ev.State.Final() {
		return
	}
	b, err := json.Marshal(ev)
	if err == nil {
		err = atomicfile.WriteBytes(filepath.Join(x.cfg.TempDir, FinalFile), b, atomicfile.Options{Perm: 0o644, UID: -1})
	}
	if err != nil {
		x.runnerLog.Warn("could not leave the job's final state for the shim", "err", err)
	}
}

func (x *Executor) job(ctx context.Context, body api.SubmitBody, user account.JobUser, wd string) {
	log := x.runnerLog
	defer x.finish()
	defer func() {
		if r := recover(); r != nil {
			log.Error("Executor failed", "panic", r)
			x.appendState(api.JobStateEvent{State: api.JobFailed, TerminationReason: api.ReasonExecutorError, TerminationMessage: fmt.Sprintf("internal error: %v", r)})
		}
	}()
	hist, err := logs.OpenHistoryRetained(filepath.Join(x.cfg.TempDir, "job.log"), x.cfg.Now, x.cfg.LogRetention)
	if err != nil {
		log.Error("Executor failed", "err", err)
		x.appendState(api.JobStateEvent{State: api.JobFailed, TerminationReason: api.ReasonExecutorError, TerminationMessage: err.Error()})
		return
	}
	x.mu.Lock()
	x.history = hist
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
		log.Error("Executor failed", "err", err)
		x.appendState(api.JobStateEvent{State: api.JobFailed, TerminationReason: api.ReasonContainerExitedWithError, TerminationMessage: fmt.Sprintf("Failed to set up the repo (%v)", err)})
		return
	}
	if err := x.setupFiles(body, user, wd, owner); err != nil {
		log.Error("Executor failed", "err", err)
		x.appendState(api.JobStateEvent{State: api.JobFailed, TerminationReason: api.ReasonExecutorError, TerminationMessage: fmt.Sprintf("Failed to set up files (%v)", err)})
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

func (x *Executor) setupRepo(body api.SubmitBody, user account.JobUser, wd string, codeBlob bool, owner repo.Owner) (string, error) {
	if body.JobSpec.RepoDir == nil {
		return "", errors.New("repo_dir is not set")
	}
	dir, err := ExpandPath(*body.JobSpec.RepoDir, user.Home, wd)
	if err != nil {
		return "", err
	}
	rd := body.JobSpec.RepoData
	if rd == nil {
		rd = body.Run.RunSpec.RepoData
	}
	repoType := api.RepoVirtual
	if rd != nil && rd.RepoType != "" {
		repoType = rd.RepoType
	}
	blob := filepath.Join(x.cfg.TempDir, "repo_blobs", blobName(body.Run.RunSpec.RepoID))
	defer os.RemoveAll(filepath.Join(x.cfg.TempDir, "repo_blobs"))
	action := body.JobSpec.RepoExistsAction
	if action == "" {
		action = "skip"
	}
	return dir, repo.Setup(repo.Spec{
		Dir:         dir,
		Type:        repoType,
		Data:        rd,
		Credentials: body.RepoCredentials,
		Blob:        blob,
		HasBlob:     codeBlob,
		Exists:      action,
		Single:      body.JobSpec.SingleBranch,
		Owner:       owner,
		Log:         x.runnerLog,
	})
}

func blobName(id string) string {
	if ident.ArchiveID(id) == nil {
		return id
	}
	return "code"
}

func (x *Executor) setupFiles(body api.SubmitBody, user account.JobUser, wd string, owner repo.Owner) error {
	dir := filepath.Join(x.cfg.TempDir, "file_archives")
	defer os.RemoveAll(dir)
	for _, fa := range body.JobSpec.FileArchives {
		dest, err := ExpandPath(fa.Path, user.Home, wd)
		if err != nil {
			return err
		}
		if err := ident.ArchiveID(fa.ID); err != nil {
			return err
		}
		f, err := os.Open(filepath.Join(dir, fa.ID))
		if err != nil {
			return fmt.Errorf("archive %s for %s: %w", fa.ID, fa.Path, err)
		}
		if err := MkdirOwned(filepath.Dir(dest), owner.UID, owner.GID); err != nil {
			f.Close()
			return err
		}
		err = repo.ExtractArchive(f, dest, owner)
		f.Close()
		if err != nil {
			return fmt.Errorf("%s: %w", fa.Path, err)
		}
	}
	return nil
}

// execute runs the command in a pty until it exits, is stopped, or the
// deadline or log quota hits; it returns the terminal state, recorded only
// after every byte of output was stored.
func (x *Executor) execute(ctx context.Context, body api.SubmitBody, user account.JobUser, wd, repoDir string, hist *logs.History) api.JobStateEvent {
	log := x.runnerLog
	failed := func(err error) api.JobStateEvent {
		log.Error("Executor failed", "err", err)
		return api.JobStateEvent{State: api.JobFailed, TerminationReason: api.ReasonExecutorError, TerminationMessage: err.Error()}
	}
	cmdline := body.JobSpec.Commands
	if len(cmdline) == 0 {
		return failed(errors.New("job has no commands"))
	}
	env, err := x.prepareJob(body, user, wd, repoDir)
	if err != nil {
		return failed(err)
	}
	spec := ptyproc.Spec{Path: cmdline[0], Args: cmdline, Dir: wd, Env: env, TTY: true, ProcRoot: x.cfg.ProcRoot}
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
	master := proc.Terminal()
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

// prepareJob writes what the job finds around it (its environment in the
// profile, the hostfile, its working dir) and returns its environment.
func (x *Executor) prepareJob(body api.SubmitBody, user account.JobUser, wd, repoDir string) ([]string, error) {
	env := JobEnv(x.cfg.BaseEnv, body, repoDir, wd, x.cfg.Paths.HostfilePath(), user.Home)
	list := account.EnvList(env) // the job's and SSH sessions' (read only by both)
	x.mu.Lock()
	x.jobEnv = list
	x.mu.Unlock()
	if err := WriteProfile(x.cfg.Paths, env); err != nil {
		x.runnerLog.Warn("write profile", "err", err)
	}
	if err := WriteHostfile(x.cfg.Paths, body.ClusterInfo); err != nil {
		return nil, err
	}
	uid, gid := -1, -1
	if x.cfg.CanSetUser {
		uid, gid = user.UID, user.GID
	}
	if err := MkdirOwned(wd, uid, gid); err != nil {
		return nil, fmt.Errorf("create working dir %s: %w", wd, err)
	}
	_ = unix.Setrlimit(unix.RLIMIT_MEMLOCK, &unix.Rlimit{Cur: unix.RLIM_INFINITY, Max: unix.RLIM_INFINITY})
	return list, nil
}

// drain waits for the job's output to end once its main process exited.
// Leftovers holding the terminal must not keep the job alive: they are
// hung up, then killed if they linger, and at last the terminal is closed.
func (x *Executor) drain(proc *ptyproc.Proc, readDone <-chan struct{}) {
	select {
	case <-readDone:
		return
	case <-time.After(x.cfg.DrainGrace / 2):
	}
	proc.SignalSession(syscall.SIGHUP)
	proc.SignalSession(syscall.SIGTERM)
	select {
	case <-readDone:
		return
	case <-time.After(x.cfg.DrainGrace / 2):
	}
	proc.SignalSession(syscall.SIGKILL)
	// Nothing writes any more: what the terminal still holds is read
	// without waiting for the log's reader (the log's bound keeps what that
	// reader has not had; the file grows by this remainder).
	x.journal.ReleaseOutput()
	select {
	case <-readDone:
	case <-time.After(time.Second):
		proc.Close()
		<-readDone
	}
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

// stopSequence stops the job like a person at the terminal would, then
// harder: Ctrl-C (the terminal's INTR character reaches the foreground
// process group, even under an interactive shell); then SIGTERM and SIGHUP
// to the whole session, then SIGKILL.
//
// An interactive shell (`sh -i -c "a && sleep 300 && b"`, how the dstack
// server runs jobs) survives Ctrl-C: the foreground job dies, the shell
// takes the terminal back and waits at a prompt until the escalation. So
// when a job had the terminal and the shell, the session leader, takes it
// back, the session is hung up at once and nothing the shell wrote after
// that moment (its prompt) is kept. A foreground program that handles
// SIGINT itself keeps the terminal, and so its full grace.
func (x *Executor) stopSequence(proc *ptyproc.Proc, cut *outputCut) {
	master, sid, exited := proc.Terminal(), proc.Pid(), proc.Exited()
	fd := int(master.Fd())
	intr := byte(3)
	if t, err := unix.IoctlGetTermios(fd, unix.TCGETS); err == nil && t.Cc[unix.VINTR] != 0 {
		intr = t.Cc[unix.VINTR]
	}
	fg0, err := unix.IoctlGetInt(fd, unix.TIOCGPGRP)
	jobHadTerminal := err == nil && fg0 > 0 && fg0 != sid
	if jobHadTerminal {
		cut.stopping()
	}
	x.runnerLog.Info("Stopping job: Ctrl-C", "session", sid, "foreground", fg0)
	_, _ = master.Write([]byte{intr})
	grace := time.After(x.cfg.InterruptGrace)
	poll := time.NewTicker(time.Millisecond)
	defer poll.Stop()
	for waiting := true; waiting; {
		select {
		case <-exited:
			return
		case <-grace:
			waiting = false
		case <-poll.C:
			if !jobHadTerminal {
				continue
			}
			if fg, err := unix.IoctlGetInt(fd, unix.TIOCGPGRP); err == nil && fg == sid {
				// The shell has the terminal again: keep what was
				// written until now, then hang up.
				pending, _ := unix.IoctlGetInt(fd, unix.TIOCINQ)
				cut.at(pending)
				proc.SignalSession(syscall.SIGHUP)
				proc.SignalSession(syscall.SIGCONT)
				x.runnerLog.Info("Stopping job: the shell took the terminal back, hung up")
				waiting = false
			}
		}
	}
	x.runnerLog.Info("Stopping job: SIGTERM and SIGHUP to the session")
	proc.SignalSession(syscall.SIGTERM)
	proc.SignalSession(syscall.SIGHUP)
	select {
	case <-exited:
		return
	case <-time.After(x.cfg.KillGrace):
	}
	x.runnerLog.Info("Stopping job: SIGKILL to the session")
	proc.SignalSession(syscall.SIGKILL)
	<-exited
}

// outputCut drops what an interactive shell writes once it took the
// terminal back on a stop: its prompt. From the Ctrl-C on, output passes a
// line at a time (a partial last line is held back until its newline);
// when the cut comes, bytes read after it and the held partial line (the
// prompt has no newline) are dropped. Safe for the reader and the stop
// sequence together.
type outputCut struct {
	mu       sync.Mutex // guards the fields below
	holding  bool       // a stop began: hold partial lines
	read     int64      // bytes the reader has taken from the terminal
	limit    int64      // keep bytes before this offset; 0: no cut yet
	held     []byte     // partial line held back
	cutTaken bool
	// firstAfter: no read was accounted since the cut. The reader may have
	// taken a chunk from the terminal just before the cut was measured
	// and not accounted it yet (it was neither read nor pending then): the
	// complete lines of the first chunk past the limit are kept, and only
	// its partial last line (a prompt) goes.
	firstAfter bool
}

func (c *outputCut) stopping() {
	c.mu.Lock()
	c.holding = true
	c.mu.Unlock()
}

// pass accounts p just read and returns what may be delivered now.
func (c *outputCut) pass(p []byte) []byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	start := c.read
	c.read += int64(len(p))
	if c.cutTaken {
		if c.firstAfter {
			if i := bytes.LastIndexByte(p, '\n'); i >= 0 && start+int64(i)+1 > c.limit {
				c.limit = start + int64(i) + 1
			}
		}
		c.firstAfter = false
		if keep := c.limit - start; keep < int64(len(p)) {
			p = p[:max(0, keep)]
		}
	}
	if !c.holding {
		return p
	}
	data := append(c.held, p...)
	i := bytes.LastIndexByte(data, '\n')
	c.held = append([]byte(nil), data[i+1:]...)
	return data[:i+1]
}

// rest is the held partial line at the end of output: kept unless the
// stop cut it (it is then the shell's prompt).
func (c *outputCut) rest() []byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cutTaken {
		return nil
	}
	return c.held
}

// at cuts after what was read so far plus pending bytes still in the
// terminal's buffer.
func (c *outputCut) at(pending int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.limit, c.cutTaken, c.firstAfter = c.read+int64(max(pending, 0)), true, true
}
