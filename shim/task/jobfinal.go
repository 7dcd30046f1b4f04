package task

// The job's final state, as the runner leaves it in its dir.

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"

	gossh "golang.org/x/crypto/ssh"
	"golang.org/x/sys/unix"

	"github.com/tandem-run/tandem/api"
)

// jobFinalFile is the runner's final state file (api.RunnerFinalFile).
const jobFinalFile = api.RunnerFinalFile

// maxJobFinal bounds the file: a state, a reason, a message.
const maxJobFinal = 64 << 10

// readJobFinal reads the final state the runner left in dir. The dir is
// the job's too (bind-mounted at /tmp/runner), so the file is read like
// any input from the job: not through a link, a regular file, bounded, and
// checked (a final state, a known reason, a bounded message).
func readJobFinal(dir string) (*api.JobStateEvent, error) {
	f, fi, err := openJobFile(dir, jobFinalFile)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if fi.Size() > maxJobFinal {
		return nil, fmt.Errorf("%s: larger than %d bytes", jobFinalFile, maxJobFinal)
	}
	b, err := io.ReadAll(io.LimitReader(f, maxJobFinal))
	if err != nil {
		return nil, err
	}
	return parseJobFinal(b)
}

// errNotRegular is a file in the runner dir that is not a regular file.
var errNotRegular = errors.New("not a regular file")

// openJobFile opens name in a runner dir, which the job can write too:
// never through a link (O_NOFOLLOW), never blocking on a FIFO, and only a
// regular file.
func openJobFile(dir, name string) (*os.File, os.FileInfo, error) {
	f, err := os.OpenFile(filepath.Join(dir, name), os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, nil, err
	}
	fi, err := f.Stat()
	if err == nil && !fi.Mode().IsRegular() {
		err = fmt.Errorf("%s: %w", name, errNotRegular)
	}
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	return f, fi, nil
}

// parseJobFinal decodes and checks a final state the job could have
// written itself.
func parseJobFinal(b []byte) (*api.JobStateEvent, error) {
	var ev api.JobStateEvent
	if err := json.Unmarshal(b, &ev); err != nil {
		return nil, fmt.Errorf("%s: %w", jobFinalFile, err)
	}
	switch {
	case !ev.State.Final():
		return nil, fmt.Errorf("%s: %q is not a final job state", jobFinalFile, ev.State)
	case ev.TerminationReason != "" && !ev.TerminationReason.Valid():
		return nil, fmt.Errorf("%s: unknown termination reason", jobFinalFile)
	case ev.ExitStatus != nil && (*ev.ExitStatus < 0 || *ev.ExitStatus > 255):
		return nil, fmt.Errorf("%s: exit status %d out of range", jobFinalFile, *ev.ExitStatus)
	}
	if len(ev.TerminationMessage) > 4096 {
		ev.TerminationMessage = ev.TerminationMessage[:4096]
	}
	return &ev, nil
}

// learnJob reads t's job final state once its runner left it, keeps it
// and persists it: it then outlives the runner and its container.
func (e *Engine) learnJob(t *task) {
	dir, err := e.runnerDir(t)
	if err != nil {
		return
	}
	ev, err := readJobFinal(dir)
	if err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			e.log.Debug("job final state unreadable", "task_id", t.cfg.ID, "err", err)
		}
		return
	}
	t.mu.Lock()
	first := t.job == nil
	if first {
		t.job = ev
	}
	t.mu.Unlock()
	if first {
		e.saveSoon(t)
	}
}

// JobLog returns the raw output the task's runner kept (its job.log),
// skipping what the runner's retention dropped (holes in the file) with a
// marker line; ErrNotFound when the task or its log is unknown. The file
// lives in the job's dir too: it is opened without following a link and
// must be a regular file.
func (e *Engine) JobLog(id string) (io.ReadCloser, error) {
	t, ok := e.lookup(id)
	if !ok {
		return nil, ErrNotFound
	}
	dir, err := e.runnerDir(t)
	if err != nil {
		return nil, ErrNotFound
	}
	f, fi, err := openJobFile(dir, "job.log")
	switch {
	case errors.Is(err, os.ErrNotExist):
		return nil, fmt.Errorf("%w: task %s has no job log", ErrNotFound, id)
	case errors.Is(err, errNotRegular), errors.Is(err, syscall.ELOOP):
		// The job made it a link, a FIFO or a directory: its own doing,
		// told without the host path.
		return nil, fmt.Errorf("%w: task %s's job log is not a regular file (the job replaced it)", ErrInvalid, id)
	case err != nil:
		e.log.Error("open job log", "task_id", id, "err", err)
		return nil, fmt.Errorf("task %s: the job log cannot be read", id)
	}
	return &dataReader{f: f, size: fi.Size()}, nil
}

// dataReader reads a file's data segments, a marker where a hole was. A
// hole is punched in whole blocks: the zeros left in the partial blocks at
// its edges are not output and are dropped too. It reads through its own
// buffer so that an edge is trimmed whatever the caller's buffer size.
type dataReader struct {
	f         *os.File
	off       int64
	size      int64
	pending   []byte // ready to hand out
	buf       []byte
	afterHole bool // off starts a segment that follows a hole
}

func (d *dataReader) Read(p []byte) (int, error) {
	for len(d.pending) == 0 {
		if err := d.fill(); err != nil {
			return 0, err
		}
	}
	n := copy(p, d.pending)
	d.pending = d.pending[n:]
	return n, nil
}

// fill puts the next piece of output (or a marker) in pending.
func (d *dataReader) fill() error {
	if d.off >= d.size {
		return io.EOF
	}
	data, err := d.f.Seek(d.off, unix.SEEK_DATA)
	if err != nil || data >= d.size {
		d.off = d.size
		return io.EOF
	}
	if data > d.off {
		d.pending = []byte("\r\n[tandem: output was dropped here to bound the job's log on disk]\r\n")
		d.off, d.afterHole = data, true
		return nil
	}
	hole, err := d.f.Seek(d.off, unix.SEEK_HOLE)
	if err != nil {
		hole = d.size
	}
	if d.buf == nil {
		d.buf = make([]byte, 64<<10)
	}
	n, err := d.f.ReadAt(d.buf[:min(int64(len(d.buf)), hole-d.off)], d.off)
	if err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	if n == 0 {
		d.off = d.size
		return io.EOF
	}
	b := d.buf[:n]
	d.off += int64(n)
	if d.afterHole { // zeros before the first byte kept
		k := 0
		for k < len(b) && k < 4096 && b[k] == 0 {
			k++
		}
		b, d.afterHole = b[k:], false
	}
	if d.off == hole && hole < d.size { // zeros after the last byte kept
		k := len(b)
		for k > 0 && len(b)-k < 4096 && b[k-1] == 0 {
			k--
		}
		b = b[:k]
	}
	d.pending = b
	return nil
}

func (d *dataReader) Close() error { return d.f.Close() }

// maxHostKeysFile bounds the runner's host public keys file: a few lines.
const maxHostKeysFile = 16 << 10

// readHostKeys reads the runner's SSH host public keys from its dir, as
// any input from the job (the dir is the job's too): not through a link,
// bounded, each line parsed as a public key and written anew, so nothing
// but a key reaches a client's known_hosts.
func readHostKeys(dir string) ([]string, error) {
	f, _, err := openJobFile(dir, api.RunnerHostKeysFile)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxHostKeysFile))
	if err != nil {
		return nil, err
	}
	var keys []string
	for len(b) > 0 && len(keys) < 8 {
		pk, _, _, rest, err := gossh.ParseAuthorizedKey(b)
		if err != nil {
			break
		}
		if k := strings.TrimSpace(string(gossh.MarshalAuthorizedKey(pk))); !slices.Contains(keys, k) {
			keys = append(keys, k)
		}
		b = rest
	}
	if len(keys) == 0 {
		return nil, fmt.Errorf("%s: no public key", api.RunnerHostKeysFile)
	}
	return keys, nil
}

// learnHostKeys keeps a running task's runner host keys once it wrote
// them (they never change); get decides when to look.
func (e *Engine) learnHostKeys(t *task) {
	dir, err := e.runnerDir(t)
	if err != nil {
		return
	}
	keys, err := readHostKeys(dir)
	if err != nil {
		return
	}
	t.mu.Lock()
	t.hostKeys = keys
	t.mu.Unlock()
}
