package runnerdir

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// refillQuiet is how long the next ready copy waits after the last start
// took one or ended: its copy and fsync beside Docker's start (which syncs
// its own metadata) cost that start 3-6 ms, and a burst of starts needs the
// CPU more than a ready copy it would take at once.
const refillQuiet = 150 * time.Millisecond

// Hold keeps the next ready copy from being made until release is called:
// a container start is under way. A fixed quiet period alone was not
// enough: where Docker's start of a bridge container takes most of a
// second (a slow host, a busy engine) the copy landed in its middle, and
// its thread's low priority counts for nothing against Docker's processes
// in other scheduling groups (autogroups, cgroups). release is idempotent;
// the quiet period counts from it.
func (d *Dirs) Hold() (release func()) {
	d.mu.Lock()
	d.holds++
	d.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			d.mu.Lock()
			d.holds--
			d.lastTake = time.Now()
			d.mu.Unlock()
		})
	}
}

// backgroundLocked runs f in the background unless closed, counted for Close.
// Called with d.mu held.
func (d *Dirs) backgroundLocked(f func()) bool {
	if d.closed {
		return false
	}
	d.bg.Add(1)
	go func() {
		defer d.bg.Done()
		f()
	}()
	return true
}

// sparePrefix names the ready copy in the runners directory.
const sparePrefix = ".ready-"

// refill makes the next ready copy in runners in the background.
func (d *Dirs) refill(runners string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.making || d.spare != "" {
		return
	}
	if d.quit == nil {
		d.quit = make(chan struct{})
	}
	quit := d.quit
	d.making = d.backgroundLocked(func() {
		for { // wait for a quiet moment: no start for refillQuiet
			d.mu.Lock()
			wait := refillQuiet - time.Since(d.lastTake)
			if d.holds > 0 {
				wait = refillQuiet
			}
			d.mu.Unlock()
			if wait <= 0 {
				break
			}
			select {
			case <-quit:
				d.mu.Lock()
				d.making = false
				d.mu.Unlock()
				return
			case <-time.After(wait):
			}
		}
		lowPriority()
		p := filepath.Join(runners, fmt.Sprintf("%s%d.ext4", sparePrefix, os.Getpid()))
		_ = os.Remove(p)
		tmpl, err := d.template(context.Background(), runners, true)
		if err == nil {
			err = copySparse(tmpl, p)
		}
		if err == nil {
			err = syncFile(p)
		}
		d.mu.Lock()
		d.making = false
		if err == nil {
			d.spare = p
		} else {
			_ = os.Remove(p)
		}
		d.mu.Unlock()
	})
}

// lowPriority gives the calling goroutine a thread of its own in the idle
// I/O class, for the rest of its life: the thread is never unlocked, so Go
// ends it with the goroutine and no other goroutine runs in that class. Its
// CPU priority is left alone: the shim runs Go code on one P on small
// hosts (common/procs), and a nice-19 thread that the kernel preempts
// while it holds that P stalls every goroutine of the shim, the API's
// included, until a busy host gives it the CPU again. The copy's work is
// the kernel's (copy_file_range, fsync), done in system calls that hand
// the P on.
func lowPriority() {
	runtime.LockOSThread()
	tid := unix.Gettid()
	const ioprioWhoProcess, ioprioClassIdle, ioprioClassShift = 1, 3, 13
	_, _, _ = unix.Syscall(unix.SYS_IOPRIO_SET, ioprioWhoProcess, uintptr(tid), ioprioClassIdle<<ioprioClassShift)
}

// takeSpare moves the ready copy, when there is one beside img, to img.
func (d *Dirs) takeSpare(img string) bool {
	d.mu.Lock()
	d.lastTake = time.Now()
	s := d.spare
	if s == "" || filepath.Dir(s) != filepath.Dir(img) {
		d.mu.Unlock()
		return false
	}
	d.spare = ""
	d.mu.Unlock()
	if err := os.Rename(s, img); err != nil {
		_ = os.Remove(s)
		return false
	}
	return true
}

func syncFile(p string) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// Close waits for the template or ready copy being made, and removes the
// ready copy; none is made after.
func (d *Dirs) Close() {
	d.mu.Lock()
	d.closed = true
	if d.quit != nil {
		close(d.quit)
		d.quit = nil
	}
	d.mu.Unlock()
	d.bg.Wait()
	d.mu.Lock()
	if d.spare != "" {
		_ = os.Remove(d.spare)
		d.spare = ""
	}
	d.mu.Unlock()
}
