package e2e

import (
	"context"
	"errors"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/e2e/testenv"
	"github.com/tandem-run/tandem/internal/diskfill"
	"github.com/tandem-run/tandem/shim/runnerdir"
	"github.com/tandem-run/tandem/shim/task"
	"golang.org/x/sys/unix"
)

// TestRunnerDirsNeverOvercommitTheHome (issue 64, item 4): with the
// DEFAULT runner-dir size (2 GiB) on a 128 MiB shim home, what every
// runner dir may still grow by never passes what the home can give above
// its floor. A job writing without end meets ENOSPC in its own dir, the
// home keeps its floor free all along, a neighbour's task still runs, and
// once the home has no room left a submit is refused with 507 before
// anything is written. Today's main gave each dir 2 GiB whatever was free:
// the job took the home to 0 bytes.
func TestRunnerDirsNeverOvercommitTheHome(t *testing.T) {
	home := smallShimHome(t)
	var st unix.Statfs_t
	if err := unix.Statfs(home, &st); err != nil {
		t.Fatal(err)
	}
	floor := runnerdir.Floor(int64(st.Blocks) * int64(st.Bsize))
	bins := testenv.Binaries(t)
	_, runnerPort, _ := net.SplitHostPort(testenv.FreeAddr(t))
	_, sshPort, _ := net.SplitHostPort(testenv.FreeAddr(t))
	h := startShim(t, bins.Runner, nil, "--shim-home", home, "--runner-http-port", runnerPort, "--runner-ssh-port", sshPort)
	freeBefore := freeBytes(t, home)
	info, r, _ := bridgeRunner(t, h, runnerPort)
	img := filepath.Join(home, "runners", info.ContainerName) + ".ext4"
	fi, err := os.Stat(img)
	if err != nil {
		t.Fatalf("the writer's runner dir is not a filesystem of its own: %v", err)
	}
	t.Logf("FIGURE home of %d bytes, %d free at start, floor %d: the writer's runner dir got %d bytes (configured %d)",
		int64(st.Blocks)*int64(st.Bsize), freeBefore, floor, fi.Size(), runnerdir.DefaultSize)
	if fi.Size() > freeBefore-floor {
		t.Fatalf("the writer's runner dir may hold %d bytes: over the %d the home has above its floor of %d", fi.Size(), freeBefore-floor, floor)
	}

	r.start(job("/bin/sh", "-c", `dd if=/dev/zero of=/tmp/runner/fill bs=1M count=4000 2>/tmp/dd.err; s=$?; n=$(grep -c "No space left on device" /tmp/dd.err); sleep 1.5; rm -f /tmp/runner/fill; sleep 1.5; echo "dd status $s enospc $n"; echo FILL-DONE`))
	lowest := lowestFree(home, freeBefore)
	res := r.pullUntilDone(2*time.Minute, nil)
	minFree := lowest()
	out := res.logs.String()
	if st := res.final(); st.State != api.JobDone || !strings.Contains(out, "dd status 1 enospc 1") || !strings.Contains(out, "FILL-DONE") {
		t.Fatalf("the job did not meet ENOSPC in its own dir: %+v %q", res.final(), tailStr(out, 600))
	}
	t.Logf("FIGURE the writer filled its dir: the home's lowest free space was %d bytes (floor %d)", minFree, floor)
	if minFree < floor {
		t.Fatalf("the home fell to %d bytes free, under its floor of %d", minFree, floor)
	}

	// A neighbour's task runs, in what the writer's dir left.
	other := h.submit(api.TaskConfig{Name: "neighbour"})
	if got := h.wait(other.ID, time.Minute, func(i api.TaskInfoResponse) bool {
		return i.Status != api.TaskPending && i.Status != api.TaskPreparing && i.Status != api.TaskPulling && i.Status != api.TaskCreating
	}); got.Status != api.TaskRunning {
		t.Fatalf("a neighbour's task: %+v", got)
	}
	// It fills its own dir too: the home keeps its floor.
	out, _ = testenv.Docker(context.Background(), "exec", task.ContainerName(other.Name, other.ID),
		"sh", "-c", "dd if=/dev/zero of=/tmp/runner/fill bs=1M count=4000 2>&1; sync")
	if !strings.Contains(out, "No space left on device") {
		t.Fatalf("the neighbour's writer did not meet ENOSPC in its own dir: %q", tailStr(out, 300))
	}
	if free := freeBytes(t, home); free < floor {
		t.Fatalf("the neighbour's dir full, the home has %d bytes free, under its floor of %d", free, floor)
	} else {
		t.Logf("FIGURE the neighbour's dir full: the home has %d bytes free (floor %d)", free, floor)
	}

	// No room left at all (something else took the home): refused, and
	// nothing of the refused task is on disk.
	fill := filepath.Join(home, "host.fill")
	diskfill.Full(t, fill)
	defer os.Remove(fill)
	refused := api.TaskConfig{ID: randomID("task"), Name: randomID("e2e"), ImageName: h.image}
	err = h.client.SubmitTask(context.Background(), refused)
	var se *api.StatusError
	if !errors.As(err, &se) || se.Code != http.StatusInsufficientStorage || !strings.Contains(se.Message, "runner dir") ||
		!strings.Contains(se.Message, "free") || strings.Contains(se.Message, home) {
		t.Fatalf("a submit with no room: %v", err)
	}
	t.Logf("FIGURE refused: %d %s", se.Code, se.Message)
	if _, err := h.client.GetTask(context.Background(), refused.ID); !errors.Is(err, api.ErrNotFound) {
		t.Fatalf("the refused task is known: %v", err)
	}
	if _, err := os.Stat(filepath.Join(home, "tasks", refused.ID+".json")); !os.IsNotExist(err) {
		t.Fatalf("the refused task's record was written: %v", err)
	}
}

// lowestFree samples path's free bytes (from at most) until the returned
// func is called, which gives the lowest seen.
func lowestFree(path string, from int64) func() int64 {
	lowest, stop, sampled := from, make(chan struct{}), make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			var st unix.Statfs_t
			if unix.Statfs(path, &st) == nil {
				lowest = min(lowest, int64(st.Bavail)*int64(st.Bsize))
			}
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	return func() int64 {
		close(stop)
		<-sampled
		return lowest
	}
}
