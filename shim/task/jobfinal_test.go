package task

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/shim/runnerdir"
)

// The runner dir is the job's too: what it leaves there is read as hostile.
func TestReadJobFinalRefusesWhatTheJobCouldForge(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, jobFinalFile)
	if _, err := readJobFinal(dir); !os.IsNotExist(err) {
		t.Fatalf("no file: %v", err)
	}
	_ = os.WriteFile(path, []byte(`{"state":"failed","timestamp":1700000000000,"termination_reason":"container_exited_with_error","exit_status":3}`), 0o644)
	ev, err := readJobFinal(dir)
	if err != nil || ev.State != api.JobFailed || ev.ExitStatus == nil || *ev.ExitStatus != 3 {
		t.Fatalf("control: %+v %v", ev, err)
	}
	secret := filepath.Join(t.TempDir(), "host-secret")
	_ = os.WriteFile(secret, []byte(`{"state":"done","exit_status":0}`), 0o600)
	_ = os.Remove(path)
	_ = os.Symlink(secret, path)
	if _, err := readJobFinal(dir); err == nil {
		t.Fatal("followed a link out of the runner dir")
	}
	_ = os.Remove(path)
	for _, bad := range []string{`{"state":"running"}`, `{"state":"done","exit_status":9999}`, `{"state":"done","termination_reason":"x\u001b"}`,
		`{"state":"done"` + strings.Repeat(" ", maxJobFinal) + `}`, `not json`} {
		_ = os.WriteFile(path, []byte(bad), 0o644)
		if ev, err := readJobFinal(dir); err == nil {
			t.Errorf("accepted %.40q: %+v", bad, ev)
		}
	}
	_ = os.Remove(path)
	_ = os.Mkdir(path, 0o755)
	if _, err := readJobFinal(dir); err == nil {
		t.Fatal("a directory was read")
	}
}

func TestJobLogSkipsHolesAndRefusesLinks(t *testing.T) {
	e, _ := newEngine(t, newStepRuntime())
	if _, err := e.Submit(api.TaskConfig{ID: "t", Name: "n", ImageName: "img"}); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, e, "t", api.TaskRunning)
	e.mu.RLock()
	dir, _ := e.runnerDir(e.tasks["t"])
	e.mu.RUnlock()
	_ = os.MkdirAll(dir, 0o755)
	log := filepath.Join(dir, "job.log")
	f, _ := os.Create(log)
	_, _ = f.WriteString("head\n")
	_, _ = f.WriteAt([]byte("tail\n"), 8<<20) // a hole in between
	f.Close()
	rc, err := e.JobLog("t")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(rc)
	rc.Close()
	if !strings.HasPrefix(string(b), "head\n") || !strings.HasSuffix(string(b), "tail\n") || !strings.Contains(string(b), "output was dropped here") || len(b) > 4096 {
		t.Fatalf("job log with a hole: %d bytes %.200q", len(b), b)
	}
	_ = os.Remove(log)
	_ = os.Symlink("/etc/passwd", log)
	// A link or a FIFO is the job's doing: a client error that names no
	// host path (issue 39), not a 500 carrying the shim home.
	if _, err := e.JobLog("t"); !errors.Is(err, ErrInvalid) || strings.Contains(err.Error(), dir) {
		t.Fatalf("a link: %v", err)
	}
	_ = os.Remove(log)
	_ = syscall.Mkfifo(log, 0o644)
	if _, err := e.JobLog("t"); !errors.Is(err, ErrInvalid) || strings.Contains(err.Error(), dir) {
		t.Fatalf("a FIFO: %v", err)
	}
}

func FuzzParseJobFinal(f *testing.F) {
	f.Add([]byte(`{"state":"failed","exit_status":3,"termination_message":"m"}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		ev, err := parseJobFinal(b)
		if err != nil {
			return
		}
		if !ev.State.Final() || len(ev.TerminationMessage) > 4096 || ev.ExitStatus != nil && (*ev.ExitStatus < 0 || *ev.ExitStatus > 255) {
			t.Fatalf("accepted %+v", ev)
		}
	})
}

// TestReadHostKeys: the runner's host keys are read as job input: keys
// only (rewritten without comments or options), never through a link,
// never from something that is not a regular file.
func TestReadHostKeys(t *testing.T) {
	dir := t.TempDir()
	const key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIC8yVbSqjrvTJsNrx0BHW0YaJvTxdnsM3I1dTKdJjLKu"
	body := key + " comment\nnot a key\n" + `command="evil" ` + key + "\n"
	if err := os.WriteFile(filepath.Join(dir, api.RunnerHostKeysFile), []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	keys, err := readHostKeys(dir)
	if err != nil || len(keys) != 1 || keys[0] != key {
		t.Fatalf("%q %v", keys, err)
	}
	link := t.TempDir()
	if err := os.Symlink(filepath.Join(dir, api.RunnerHostKeysFile), filepath.Join(link, api.RunnerHostKeysFile)); err != nil {
		t.Fatal(err)
	}
	if _, err := readHostKeys(link); err == nil {
		t.Fatal("read through a link")
	}
	fifo := t.TempDir()
	if err := syscall.Mkfifo(filepath.Join(fifo, api.RunnerHostKeysFile), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := readHostKeys(fifo); err == nil {
		t.Fatal("read a FIFO")
	}
}

// A GET's look for the job's final state is spaced out (pollers); a fresh
// GET looks at once, so a client acting on the job's end sees it as soon
// as the runner wrote it.
func TestGetFreshSeesTheJobEndAtOnce(t *testing.T) {
	rt := newStepRuntime()
	e := gatedEngine(t, rt, &runnerdir.Dirs{})
	at := time.Unix(1_800_000_000, 0)
	e.now = func() time.Time { return at } // no second passes between GETs
	if _, err := e.Submit(api.TaskConfig{ID: "t", Name: "n", ImageName: "img:1"}); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, e, "t", api.TaskRunning)
	if info, _ := e.Get("t"); info.Tandem != nil && info.Tandem.Job != nil {
		t.Fatalf("a job state before the runner wrote one: %+v", info.Tandem.Job)
	}
	tk, _ := e.lookup("t")
	dir, err := e.runnerDir(tk)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, jobFinalFile), []byte(`{"state":"failed","timestamp":1700000000000,"exit_status":3}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if info, _ := e.Get("t"); info.Tandem != nil && info.Tandem.Job != nil {
		t.Fatal("a plain GET looked again within jobLookEvery")
	}
	info, err := e.GetFresh("t")
	if err != nil || info.Tandem == nil || info.Tandem.Job == nil || info.Tandem.Job.State != api.JobFailed {
		t.Fatalf("fresh GET: %+v %v", info.Tandem, err)
	}
}

// Host keys the runner has not written yet are looked for at most every
// hostKeysLookEvery by plain GETs (pollers), at once by a fresh one (a client
// waiting to trust the runner), and kept once found.
func TestHostKeysLookIsSpacedOut(t *testing.T) {
	rt := newStepRuntime()
	e := gatedEngine(t, rt, &runnerdir.Dirs{})
	at := time.Unix(1_800_000_000, 0)
	var mu sync.Mutex
	e.now = func() time.Time { mu.Lock(); defer mu.Unlock(); return at }
	if _, err := e.Submit(api.TaskConfig{ID: "t", Name: "n", ImageName: "img:1"}); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, e, "t", api.TaskRunning)
	keysOf := func(info api.TaskInfoResponse) []string {
		if info.Tandem == nil {
			return nil
		}
		return info.Tandem.HostKeys
	}
	if info, _ := e.Get("t"); keysOf(info) != nil {
		t.Fatalf("keys before the runner wrote any: %v", keysOf(info))
	}
	key := writeHostKey(t, e, "t")
	if info, _ := e.Get("t"); keysOf(info) != nil {
		t.Fatal("a plain GET looked again within hostKeysLookEvery")
	}
	mu.Lock()
	at = at.Add(hostKeysLookEvery)
	mu.Unlock()
	if info, _ := e.Get("t"); len(keysOf(info)) != 1 || keysOf(info)[0] != key {
		t.Fatalf("a GET hostKeysLookEvery later: %v", keysOf(info))
	}

	// A fresh GET looks at once.
	if _, err := e.Submit(api.TaskConfig{ID: "u", Name: "m", ImageName: "img:1"}); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, e, "u", api.TaskRunning)
	_, _ = e.Get("u")
	writeHostKey(t, e, "u")
	if info, _ := e.GetFresh("u"); len(keysOf(info)) != 1 {
		t.Fatalf("a fresh GET: %v", keysOf(info))
	}
}

// Each plain look that finds no host keys doubles the wait before the
// next (a runner that writes none is not looked for on every poll), up to
// hostKeysLookMax; found keys show at the next look.
func TestHostKeysLooksBackOff(t *testing.T) {
	for looks, want := range map[int]time.Duration{0: 100 * time.Millisecond, 1: 100 * time.Millisecond, 2: 200 * time.Millisecond, 3: 400 * time.Millisecond,
		6: 3200 * time.Millisecond, 7: hostKeysLookMax, 64: hostKeysLookMax, 1 << 30: hostKeysLookMax} {
		if got := keysSpacing(looks); got != want {
			t.Errorf("keysSpacing(%d) = %v, want %v", looks, got, want)
		}
	}
	rt := newStepRuntime()
	e := gatedEngine(t, rt, &runnerdir.Dirs{})
	at := time.Unix(1_800_000_000, 0)
	var mu sync.Mutex
	e.now = func() time.Time { mu.Lock(); defer mu.Unlock(); return at }
	advance := func(d time.Duration) {
		mu.Lock()
		at = at.Add(d)
		mu.Unlock()
	}
	if _, err := e.Submit(api.TaskConfig{ID: "t", Name: "n", ImageName: "img:1"}); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, e, "t", api.TaskRunning)
	found := func() bool {
		info, err := e.Get("t")
		if err != nil {
			t.Fatal(err)
		}
		return info.Tandem != nil && len(info.Tandem.HostKeys) > 0
	}
	// Looks at 0, +100 ms and +300 ms find nothing; the next is due 400 ms
	// after the third.
	for _, d := range []time.Duration{0, 100 * time.Millisecond, 200 * time.Millisecond} {
		advance(d)
		if found() {
			t.Fatal("keys before the runner wrote any")
		}
	}
	writeHostKey(t, e, "t")
	advance(399 * time.Millisecond)
	if found() {
		t.Fatal("looked again 399 ms after the third look (the wait is 400 ms)")
	}
	advance(time.Millisecond)
	if !found() {
		t.Fatal("the keys were not found 400 ms after the third look")
	}
}

// writeHostKey writes a host key into task id's runner dir, as the runner
// does once its SSH server listens, and returns it.
func writeHostKey(t *testing.T, e *Engine, id string) string {
	t.Helper()
	tk, ok := e.lookup(id)
	if !ok {
		t.Fatalf("no task %s", id)
	}
	dir, err := e.runnerDir(tk)
	if err != nil {
		t.Fatal(err)
	}
	const key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIC8yVbSqjrvTJsNrx0BHW0YaJvTxdnsM3I1dTKdJjLKu"
	if err := os.WriteFile(filepath.Join(dir, api.RunnerHostKeysFile), []byte(key+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return key
}
