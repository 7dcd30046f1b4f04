// Package executor owns the runner's one job: the state machine of the
// runner API, preparing code, files and environment, running the command in
// a pty as the job user, stopping it for real, and the event streams that
// /api/pull and /logs_ws serve.
package executor

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	gossh "golang.org/x/crypto/ssh"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/ident"
	"github.com/tandem-run/tandem/common/logging"
	"github.com/tandem-run/tandem/runner/account"
	"github.com/tandem-run/tandem/runner/logs"
)

// State is the runner's state (not on the wire).
type State string

const (
	WaitSubmit       State = "wait_submit"
	WaitRun          State = "wait_run"
	ServeLogs        State = "serve_logs"
	WaitLogsFinished State = "wait_logs_finished"
)

// Error classes for the HTTP layer.
var (
	ErrState    = errors.New("not allowed in the current state")
	ErrBadInput = errors.New("bad input")
	ErrTooLarge = errors.New("upload too large")
)

// Default upload limits (api.MaxUpload: what a client may send at once).
const (
	DefaultMaxUpload      = api.MaxUpload // one upload_code or upload_archive body
	DefaultMaxUploadTotal = 1 << 30       // all uploads of a job together
)

// Config is how the executor runs jobs.
type Config struct {
	TempDir  string
	Paths    Paths
	Accounts account.Accounts
	ProcRoot string // "/proc"
	// CgroupRoot is where the container's cgroup is mounted ("/sys/fs/cgroup";
	// "" skips OOM detection): its OOM-kill counter tells an out-of-memory
	// SIGKILL from any other.
	CgroupRoot string
	SelfUID    int
	// CanSetUser is whether the runner may switch credentials (root with
	// CAP_SETUID/SETGID); otherwise the job runs as the runner's user.
	CanSetUser bool
	BaseEnv    []string
	// InterruptGrace is how long Ctrl-C is given before SIGTERM/SIGHUP to the
	// whole session; KillGrace then before SIGKILL.
	InterruptGrace, KillGrace time.Duration
	// DrainGrace bounds reading output after the main process exited while
	// leftover processes keep the terminal open.
	DrainGrace time.Duration
	// PullCap bounds the log bytes of one /api/pull answer.
	PullCap int
	Now     func() time.Time
	Log     *slog.Logger
	Stdout  io.Writer
	// Connections reports SSH activity for no_connections_secs (may be nil).
	Connections Connections
	// AuthorizeKey adds a key to the SSH server's shared authorized keys
	// (a multi-node job's key, at run)
	// (the job's multi-node key); may be nil.
	AuthorizeKey func(line string) error
	// SSHPort is written into ~/.ssh/config for the other nodes.
	SSHPort int
	// MaxUpload bounds one uploaded body, MaxUploadTotal all of them
	// (DefaultMaxUpload, DefaultMaxUploadTotal); past them: ErrTooLarge.
	MaxUpload, MaxUploadTotal int64
	// LogRetention bounds each of the job's two log files on disk (raw
	// output, stripped lines); zero: logs.DefaultLogMax and
	// DefaultLogHead; Max < 0: unbounded.
	LogRetention logs.Retention
	// ReaderGrace: while the reader of /api/pull (the server) pulled
	// within it, the job's output is held for it rather than have the log's
	// bound drop what it has not had (logs.DefaultReaderGrace; < 0: never
	// held).
	ReaderGrace time.Duration
	// LogMinFree is the free space under TempDir below which the job's
	// output is no longer kept (the job goes on); 0: logs.DefaultMinFree
	// of the filesystem; < 0: none.
	LogMinFree int64
	// HostFS is a path on the host's filesystem under the runner dir (an
	// empty read-only directory the shim binds in), watched with its own
	// floor (a tenth of it, at most 256 MiB; LogMinFree when set) when
	// TempDir is a filesystem of its own; "" none.
	HostFS string
	// HostMinFree is HostFS's floor, set by New.
	HostMinFree int64
}

// Connections is the SSH server's activity, as the executor needs it.
type Connections interface {
	Start(now time.Time)
	NoConnectionsSecs(now time.Time) int64
}

// Executor runs one job.
type Executor struct {
	cfg Config

	finalErr atomic.Pointer[error] // writing the final state's file failed

	mu       sync.Mutex // guards the fields below
	state    State
	body     *api.SubmitBody
	codeBlob bool
	submitAt time.Time
	cancel   context.CancelFunc
	history  *logs.History
	// historyReady is closed once history is set (the job's output has a
	// home); History waits on it.
	historyReady chan struct{}
	stopped      bool
	started      chan struct{}    // closed by run
	finished     chan struct{}    // closed when the job goroutine ended
	jobEnv       []string         // the job's environment once built, for SSH sessions
	uploads      map[string]int64 // stored upload path → its size
	stdin        *stdinFeed       // the job's stream (api.StdinStream, or a TTY size); nil otherwise
	term         jobTerm          // the job's terminal size

	// journal holds what /api/pull serves: job states, job and runner logs.
	journal   *logs.Journal
	runnerLog *slog.Logger
	pullDone  chan struct{}
	pullOnce  sync.Once
	streamers Followers
}

// Defaults are the executor's defaults: New fills the zero fields of its
// Config from them (WithDefaults), and the runner's flags show and use the
// same values.
func Defaults() Config {
	return Config{
		ProcRoot:       "/proc",
		CgroupRoot:     "/sys/fs/cgroup",
		InterruptGrace: 3 * time.Second,
		KillGrace:      5 * time.Second,
		DrainGrace:     2 * time.Second,
		PullCap:        1 << 20,
		ReaderGrace:    logs.DefaultReaderGrace,
		MaxUpload:      DefaultMaxUpload,
		MaxUploadTotal: DefaultMaxUploadTotal,
		LogRetention:   logs.Retention{Head: logs.DefaultLogHead, Max: logs.DefaultLogMax},
	}
}

// WithDefaults returns c with its zero fields taken from Defaults (and a
// clock, a logger and an output), but CgroupRoot, whose empty value skips
// OOM detection, and LogMinFree, which New sizes from the filesystem.
func (c Config) WithDefaults() Config {
	d := Defaults()
	c.ProcRoot = cmp.Or(c.ProcRoot, d.ProcRoot)
	c.InterruptGrace = cmp.Or(c.InterruptGrace, d.InterruptGrace)
	c.KillGrace = cmp.Or(c.KillGrace, d.KillGrace)
	c.DrainGrace = cmp.Or(c.DrainGrace, d.DrainGrace)
	c.PullCap = cmp.Or(c.PullCap, d.PullCap)
	c.ReaderGrace = cmp.Or(c.ReaderGrace, d.ReaderGrace)
	c.MaxUpload = cmp.Or(c.MaxUpload, d.MaxUpload)
	c.MaxUploadTotal = cmp.Or(c.MaxUploadTotal, d.MaxUploadTotal)
	switch {
	case c.LogRetention.Max == 0:
		c.LogRetention = d.LogRetention
	case c.LogRetention.Max < 0: // unbounded
		c.LogRetention = logs.Retention{}
	}
	// Paths not given stay under the temp dir, never relative to the
	// process's working dir (the runner's own sets both).
	if c.Paths.DstackDir == "" {
		c.Paths.DstackDir = filepath.Join(c.TempDir, "dstack")
	}
	if c.Paths.EtcProfile == "" {
		c.Paths.EtcProfile = filepath.Join(c.Paths.DstackDir, "etc-profile")
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Log == nil {
		c.Log = logging.Discard()
	}
	if c.Stdout == nil {
		c.Stdout = io.Discard
	}
	return c
}

// New prepares the temp dir and event stores.
func New(cfg Config) (*Executor, error) {
	cfg = cfg.WithDefaults()
	if err := os.MkdirAll(cfg.TempDir, 0o755); err != nil {
		return nil, fmt.Errorf("temp dir: %w", err)
	}
	cfg.HostMinFree = cfg.LogMinFree // an operator's floor is for both
	if cfg.LogMinFree == 0 {
		if size, err := logs.FSSize(cfg.TempDir); err == nil {
			cfg.LogMinFree = logs.DefaultMinFree(size)
		}
	}
	if cfg.HostFS != "" {
		if size, err := logs.FSSize(cfg.HostFS); err != nil {
			cfg.HostFS = "" // not there: a runner started without the shim's probe
		} else if cfg.HostMinFree == 0 {
			cfg.HostMinFree = logs.DefaultMinFree(size)
		}
	}
	x := &Executor{cfg: cfg, state: WaitSubmit,
		started: make(chan struct{}), finished: make(chan struct{}), pullDone: make(chan struct{}), historyReady: make(chan struct{})}
	// The shim's file has the end before any reader does: one who saw
	// the job end and at once removes its task (tandem attach, then rm)
	// finds the shim knowing it ended too.
	j, err := logs.OpenJournal(cfg.TempDir, logs.JournalConfig{Now: cfg.Now, Log: cfg.Log, Retention: cfg.LogRetention, ReaderGrace: cfg.ReaderGrace,
		BeforeFinal: x.writeFinal})
	if err != nil {
		return nil, err
	}
	x.journal = j
	return x, nil
}

// Close releases the event stores' files. The job must have finished (or
// never run).
func (x *Executor) Close() error {
	return x.journal.Close()
}

// NoPull reports whether the submitted job said no /api/pull reader will
// come (api.SubmitExtras).
func (x *Executor) NoPull() bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.body != nil && x.body.Tandem != nil && x.body.Tandem.NoPull
}

// TempDir is where uploads and logs are kept.
func (x *Executor) TempDir() string { return x.cfg.TempDir }

// State returns the current state.
func (x *Executor) State() State {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.state
}

// Started is closed once /api/run was accepted.
func (x *Executor) Started() <-chan struct{} { return x.started }

// Finished is closed when the job has ended and every event was recorded.
func (x *Executor) Finished() <-chan struct{} { return x.finished }

// PullConsumed is closed once a pull delivered everything after the end.
func (x *Executor) PullConsumed() <-chan struct{} { return x.pullDone }

// Submit stores the job (allowed before run, again while waiting for run).
func (x *Executor) Submit(b api.SubmitBody) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	if !canMove(x.state, WaitRun) {
		return fmt.Errorf("%w: submit in state %s", ErrState, x.state)
	}
	// The cluster key is checked now and authorized at run, from the
	// submit that runs (as dstack's runner does; the server runs a
	// multi-node master only once every other node runs): a submit that
	// is replaced leaves no key behind.
	if k := b.JobSpec.SSHKey; k != nil && k.Public != "" && len(b.ClusterInfo.JobIPs) >= 2 {
		if _, _, _, _, err := gossh.ParseAuthorizedKey([]byte(k.Public)); err != nil {
			return fmt.Errorf("%w: job_spec.ssh_key.public: %v", ErrBadInput, err)
		}
	}
	mode, err := stdinMode(b)
	if err != nil {
		return err
	}
	size, err := termSize(b)
	if err != nil {
		return err
	}
	if x.state == WaitRun {
		// Nothing of the replaced submit may reach the job that runs: its
		// uploads (code, archives) go with it.
		x.cfg.Log.Warn("job re-submitted; replacing the previous one and discarding its uploads", "uploads", len(x.uploads))
		for p := range x.uploads {
			_ = os.Remove(p)
		}
		x.uploads, x.codeBlob = nil, false
	}
	x.body = &b
	x.submitAt = x.cfg.Now()
	// A replaced submit's stdin feeder is cut off: its job never runs.
	x.endStdinLocked()
	x.stdin = nil
	if mode == api.StdinStream || size != nil {
		x.stdin = newStdinFeed(mode == api.StdinStream)
	}
	x.term = jobTerm{size: size}
	return x.moveLocked(WaitRun, "submit")
}

// UploadArchive stores a file archive under its id.
func (x *Executor) UploadArchive(id string, r io.Reader) error {
	if err := ident.ArchiveID(id); err != nil {
		return fmt.Errorf("%w: %v", ErrBadInput, err)
	}
	if err := x.requireState(WaitRun, "upload_archive"); err != nil {
		return err
	}
	return x.storeUpload(filepath.Join(x.cfg.TempDir, "file_archives", id), r)
}

// UploadCode stores the code blob (a tar, or a diff for remote repos).
func (x *Executor) UploadCode(r io.Reader) error {
	if err := x.requireState(WaitRun, "upload_code"); err != nil {
		return err
	}
	x.mu.Lock()
	id := x.body.Run.RunSpec.RepoID
	x.mu.Unlock()
	id = blobName(id)
	if err := x.storeUpload(filepath.Join(x.cfg.TempDir, "repo_blobs", id), r); err != nil {
		return err
	}
	x.mu.Lock()
	x.codeBlob = true
	x.mu.Unlock()
	return nil
}

func (x *Executor) requireState(s State, what string) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.state != s {
		return fmt.Errorf("%w: %s in state %s", ErrState, what, x.state)
	}
	return nil
}

// readErrReader remembers a read error, to tell a broken request (the
// client's fault) from a failing disk (ours).
type readErrReader struct {
	r   io.Reader
	err error
}

func (r *readErrReader) Read(p []byte) (int, error) {
	n, err := r.r.Read(p)
	if err != nil && !errors.Is(err, io.EOF) {
		r.err = err
	}
	return n, err
}

// storeUpload writes one upload within the per-upload and per-job limits.
// It lands whole or not at all: a replaced upload (a retried request) is
// written beside the one it replaces and takes its place only once it
// arrived whole and within the limits, so a retry that fails, or two that
// overlap, never leave a cut or mixed file, nor lose the one before.
// Nothing of a refused upload is left on disk.
func (x *Executor) storeUpload(path string, r io.Reader) error {
	x.mu.Lock()
	if x.uploads == nil {
		x.uploads = map[string]int64{}
	}
	var used int64
	for p, n := range x.uploads {
		if p != path {
			used += n
		}
	}
	x.mu.Unlock()
	limit := min(x.cfg.MaxUpload, x.cfg.MaxUploadTotal-used)
	lr := &io.LimitedReader{R: r, N: limit + 1}
	tmp, err := writeTemp(path, lr)
	if err != nil {
		return err
	}
	size := limit + 1 - lr.N
	if size > limit {
		_ = os.Remove(tmp)
		if limit < x.cfg.MaxUpload {
			return fmt.Errorf("%w: the job's uploads would exceed %d bytes in all", ErrTooLarge, x.cfg.MaxUploadTotal)
		}
		return fmt.Errorf("%w: more than %d bytes", ErrTooLarge, x.cfg.MaxUpload)
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if err := os.Rename(tmp, path); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("store upload: %w", err)
	}
	x.uploads[path] = size
	return nil
}

// writeTemp writes an upload to a new file beside path and returns its
// name; a failed upload leaves no file.
func writeTemp(path string, r io.Reader) (string, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return "", fmt.Errorf("store upload: %w", err)
	}
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".part-*")
	if err != nil {
		return "", fmt.Errorf("store upload: %w", err)
	}
	rr := &readErrReader{r: r}
	_, err = io.Copy(f, rr)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = os.Remove(f.Name())
		if rr.err != nil {
			return "", fmt.Errorf("%w: reading the upload: %v", ErrBadInput, rr.err)
		}
		return "", fmt.Errorf("store upload: %w", err)
	}
	return f.Name(), nil
}

// appendState records a job state event if the job may enter it
// (api.JobState.CanFollow); a refused one is logged, never recorded.
func (x *Executor) appendState(ev api.JobStateEvent) { _ = x.journal.AppendState(ev) }

// Stop cancels a running job (graceful stop, then escalation). Before run
// it ends the runner's wait for a job.
func (x *Executor) Stop() {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.stopped = true
	if x.state == ServeLogs {
		if x.cancel != nil {
			x.cancel()
		}
		return
	}
	x.endStdinLocked() // no job will read it

	_ = x.moveLocked(WaitLogsFinished, "stop") // allowed from every state
}

// Pull returns the events after ts, at most PullCap bytes of logs; when the
// cap cut the answer, last_updated is the last included event and has_more
// is true.
func (x *Executor) Pull(after int64) (api.PullResponse, error) {
	return x.pull(after, pullMode{consume: true, logs: true})
}

// Peek is Pull for onlookers (tandem ps): reading the end does not count as
// the logs being collected, so the runner does not finish on account of it.
func (x *Executor) Peek(after int64) (api.PullResponse, error) {
	return x.pull(after, pullMode{logs: true})
}

// PullStates is Pull without the logs, for a driver that reads the job's
// output from /logs_ws (tandem run): the answer holds the job's states and
// last_updated is the newest event, whatever the logs hold. It counts as
// collection at the end, as Pull does, but not as a reader of the logs: the
// job's output is never held back for it (a journal it does not read would
// pace the job at one page per poll, 2 MiB/s).
func (x *Executor) PullStates(after int64) (api.PullResponse, error) {
	return x.pull(after, pullMode{consume: true})
}

// PeekStates is PullStates for onlookers (tandem attach): the states
// only, and reading the end does not count as collection.
func (x *Executor) PeekStates(after int64) (api.PullResponse, error) {
	return x.pull(after, pullMode{})
}

// FinalState is the job's final state once recorded (an onlooker's look:
// it collects nothing); ok is false before.
func (x *Executor) FinalState() (ev api.JobStateEvent, ok bool) {
	p, err := x.pull(0, pullMode{})
	if err != nil || len(p.JobStates) == 0 {
		return ev, false
	}
	ev = p.JobStates[len(p.JobStates)-1]
	return ev, ev.State.Final()
}

// pullMode is what a pull reads and counts as.
type pullMode struct {
	consume bool // reading the end collects the logs (the runner may finish)
	logs    bool // the answer carries the logs; with consume, acks them
}

func (x *Executor) pull(after int64, m pullMode) (api.PullResponse, error) {
	resp := api.PullResponse{JobStates: []api.JobStateEvent{}, JobLogs: []api.LogEvent{}, RunnerLogs: []api.LogEvent{}}
	capped := false
	if m.logs {
		if m.consume {
			x.journal.Acked(after)
		}
		w, err := x.journal.Since(after, x.cfg.PullCap)
		if err != nil {
			return resp, err
		}
		capped = w.Capped
		resp.LastUpdated = w.LastUpdated
		resp.JobStates = append(resp.JobStates, w.States...)
		for _, e := range w.JobLogs {
			resp.JobLogs = append(resp.JobLogs, api.LogEvent{Message: e.Data, Timestamp: e.Timestamp})
		}
		for _, e := range w.RunnerLogs {
			resp.RunnerLogs = append(resp.RunnerLogs, api.LogEvent{Message: e.Data, Timestamp: e.Timestamp})
		}
	} else {
		states, last := x.journal.StatesSince(after)
		resp.JobStates, resp.LastUpdated = append(resp.JobStates, states...), last
	}
	if x.cfg.Connections != nil {
		resp.NoConnectionsSecs = x.cfg.Connections.NoConnectionsSecs(x.cfg.Now())
	}
	state := x.State()
	resp.HasMore = capped || state != WaitLogsFinished
	if m.consume && state == WaitLogsFinished && !capped {
		x.pullOnce.Do(func() { close(x.pullDone) })
	}
	return resp, nil
}

// History waits until the job's output history exists (after run) and
// returns it; nil when the runner ended without running a job.
func (x *Executor) History(ctx context.Context) (*logs.History, error) {
	select {
	case <-x.started:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	select {
	case <-x.historyReady:
	case <-x.finished: // ended without one (it failed before)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.history, nil
}

// HistoryIfStarted is the job's output history when the job has started,
// else nil (no output yet), without waiting.
func (x *Executor) HistoryIfStarted() *logs.History {
	select {
	case <-x.historyReady:
	default:
		return nil
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.history
}

// SessionEnv is the environment SSH sessions start from: the job's once it
// was built, else the runner's own.
func (x *Executor) SessionEnv() []string {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.jobEnv != nil {
		return x.jobEnv
	}
	return x.cfg.BaseEnv
}

// Streamers tracks WebSocket clients so shutdown can wait for them.
func (x *Executor) Streamers() *Followers { return &x.streamers }

// Followers counts the output streams being served. Unlike a WaitGroup,
// one may join while another's end is being waited for (an attach that
// comes as the last follower leaves): Idle is asked anew for each wait.
type Followers struct {
	mu   sync.Mutex
	n    int
	idle chan struct{} // closed while n is 0; nil: never joined
}

// Join counts a follower in; the returned func counts it out (once).
func (f *Followers) Join() (leave func()) {
	f.mu.Lock()
	if f.n == 0 {
		f.idle = make(chan struct{})
	}
	f.n++
	f.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			f.mu.Lock()
			defer f.mu.Unlock()
			if f.n--; f.n == 0 {
				close(f.idle)
			}
		})
	}
}

// Idle is closed once no follower is being served (at once when none is).
func (f *Followers) Idle() <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.n == 0 {
		ch := make(chan struct{})
		close(ch)
		return ch
	}
	return f.idle
}
