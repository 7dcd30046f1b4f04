package metrics

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/toolrun"
)

const (
	// amd-smi is a Python program: 0.5-2 s on an 8-GPU host. The server
	// asks every 10 s; a run past 5 s is a tool that hangs.
	defaultToolTimeout = 5 * time.Second
	// 256 GPUs (an MI300X host in CPX mode has 64) of amd-smi's widest CSV
	// row (~120 bytes) fit twice.
	defaultToolOutput = 64 << 10
	// toolWaitDelay is how long a finished or killed tool's children may
	// keep its stdout open before the pipe is closed under them.
	toolWaitDelay = 500 * time.Millisecond
	// maxGPUs bounds the list one answer carries, whatever a tool prints.
	maxGPUs = 256
)

// runTool runs a vendor tool of the job's image, bounded: it is killed with
// its process group past timeout or past limit bytes of stdout, and stdin
// and stderr are /dev/null. The image is the job's, so the tool is the
// job's: it may hang, print without end or fork children that hold the pipe.
func runTool(ctx context.Context, timeout time.Duration, limit int, bin string, args ...string) ([]byte, error) {
	out, _, err := toolrun.Run(ctx, toolrun.Bounds{Timeout: timeout, Stdout: limit, WaitDelay: toolWaitDelay}, bin, args...)
	return out, err
}

// flight runs one GPU read at a time: a request that comes while one is
// under way waits for it and shares its answer, so a burst of /api/metrics
// calls starts one amd-smi, not one each in the job's memory.
type flight struct {
	mu  sync.Mutex
	cur *flightCall // guarded by mu
}

type flightCall struct {
	done chan struct{}
	gpus []api.GPUMetrics // written before done is closed
}

// do returns fn's answer, from the run in flight if there is one. The run
// is not cancelled by ctx (other requests may wait on it; it is bounded by
// the tool's own time bound); a caller whose ctx ends gets no GPUs.
func (f *flight) do(ctx context.Context, fn func(context.Context) []api.GPUMetrics) []api.GPUMetrics {
	f.mu.Lock()
	c := f.cur
	if c == nil {
		c = &flightCall{done: make(chan struct{})}
		f.cur = c
		run := context.WithoutCancel(ctx)
		go func() {
			c.gpus = fn(run)
			f.mu.Lock()
			f.cur = nil
			f.mu.Unlock()
			close(c.done)
		}()
	}
	f.mu.Unlock()
	select {
	case <-c.done:
		return c.gpus
	case <-ctx.Done():
		return []api.GPUMetrics{}
	}
}

// logOnce logs each of a fixed set of conditions the first time it is seen:
// the server asks every 10 s, and "amd-smi is not in the image" is news
// once.
type logOnce struct {
	mu   sync.Mutex
	seen map[string]bool // guarded by mu
}

func (o *logOnce) warn(log *slog.Logger, key, msg string, args ...any) {
	o.mu.Lock()
	first := !o.seen[key]
	if first {
		if o.seen == nil {
			o.seen = map[string]bool{}
		}
		o.seen[key] = true
	}
	o.mu.Unlock()
	if first {
		log.Warn(msg, args...)
	}
}

// errUntrusted is a tool another account than the runner's could have
// written or replaced.
var errUntrusted = errors.New("writable by another account than the runner's")

// trusted checks that the tool, after its links, and every directory
// above it are the runner's account's or root's and writable by no one
// else (a directory writable by all is fine with the sticky bit: a
// root-owned entry in it cannot be replaced). What the tool loads in turn
// (a Python's modules) is the image's, as the job's whole environment is.
func trusted(bin string) error {
	real, err := filepath.EvalSymlinks(bin)
	if err != nil {
		return err
	}
	real, err = filepath.Abs(real)
	if err != nil {
		return err
	}
	me := uint32(os.Getuid())
	owned := func(p string, fi os.FileInfo) error {
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return fmt.Errorf("%s: no owner", p)
		}
		if st.Uid != 0 && st.Uid != me {
			return fmt.Errorf("%s is owned by uid %d: %w", p, st.Uid, errUntrusted)
		}
		return nil
	}
	fi, err := os.Stat(real)
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("%s: not a regular file", real)
	}
	if err := owned(real, fi); err != nil {
		return err
	}
	if fi.Mode().Perm()&0o022 != 0 {
		return fmt.Errorf("%s (mode %v): %w", real, fi.Mode().Perm(), errUntrusted)
	}
	for d := filepath.Dir(real); ; d = filepath.Dir(d) {
		fi, err := os.Stat(d)
		if err != nil {
			return err
		}
		if err := owned(d, fi); err != nil {
			return err
		}
		if fi.Mode().Perm()&0o022 != 0 && fi.Mode()&os.ModeSticky == 0 {
			return fmt.Errorf("%s (mode %v): %w", d, fi.Mode().Perm(), errUntrusted)
		}
		if d == filepath.Dir(d) {
			return nil
		}
	}
}
