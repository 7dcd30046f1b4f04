package runnerdir

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
)

const mb = 1 << 20

func TestFloor(t *testing.T) {
	for _, c := range []struct{ total, want int64 }{
		{0, 16 * mb},
		{128 * mb, 16 * mb},
		{640 * mb, 64 * mb},
		{1 << 30, 64 * mb * 16 / 10}, // a tenth: 102.4 MiB
		{100 << 30, 256 * mb},
	} {
		if got := Floor(c.total); got != c.want {
			t.Errorf("Floor(%d) = %d, want %d", c.total, got, c.want)
		}
	}
}

// The rule as a table: what a new dir gets (share), what a booked one
// keeps at Make, and what is refused.
func TestDecide(t *testing.T) {
	const want, least = 2048 * mb, 32 * mb
	big := Space{Free: 100 << 30, Total: 200 << 30} // floor 256 MiB
	small := Space{Free: 200 * mb, Total: 640 * mb} // floor 64 MiB: 136 MiB left
	cases := []struct {
		name    string
		want    int64
		sp      Space
		claimed int64
		share   bool
		size    int64 // 0: refused
	}{
		{"room for twice the size: the size", want, big, 0, true, want},
		{"the others' claims count", want, big, 100<<30 - 256*mb - want*3/2, true, want * 3 / 4},
		{"a small home: half of what is left, whole MiBs", want, small, 0, true, 68 * mb},
		{"less left than twice the least: the least", want, small, 136*mb - 40*mb, true, least},
		{"exactly the least left", want, small, 136*mb - least, true, least},
		{"under the least left: refused", want, small, 136*mb - least + 1, true, 0},
		{"the floor alone: refused", want, Space{Free: 64 * mb, Total: 640 * mb}, 0, true, 0},
		{"claims past the free space: refused", want, small, 1 << 40, true, 0},
		{"free under the floor: refused", want, Space{Free: 10 * mb, Total: 640 * mb}, 0, true, 0},
		{"booked, still fits: its size", 68 * mb, small, 0, false, 68 * mb},
		{"booked, room taken since: what is left", 68 * mb, small, 136*mb - 50*mb, false, 50 * mb},
		{"booked, under the least left: refused", 68 * mb, small, 136*mb - 31*mb, false, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			size, err := decide(c.want, least, c.sp, c.claimed, c.share)
			if c.size == 0 {
				var nr *NoRoomError
				if !errors.As(err, &nr) || !errors.Is(err, ErrNoRoom) {
					t.Fatalf("got %d, %v; want refused", size, err)
				}
				return
			}
			if err != nil || size != c.size {
				t.Fatalf("got %d, %v; want %d", size, err, c.size)
			}
			if size+c.claimed > c.sp.Free-Floor(c.sp.Total) {
				t.Fatalf("%d over the room", size)
			}
		})
	}
}

// fakeSpace is a filesystem of total bytes with free bytes free.
func fakeSpace(free, total int64) func(string) (Space, error) {
	return func(string) (Space, error) { return Space{Free: free, Total: total}, nil }
}

// image writes a sparse image of size bytes for dir with written bytes of
// data, as a previous run left it.
func image(t *testing.T, dir string, size, written int64) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(imagePath(dir))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Write(make([]byte, written)); err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
}

// Images on disk (a previous run's, re-attached after a restart) claim
// their size less what they hold; the template and the ready copy claim
// nothing. A submit that the room does not fit is refused with the
// numbers, and nothing is booked.
func TestReserveCountsTheImagesOnDisk(t *testing.T) {
	runners := filepath.Join(t.TempDir(), "runners")
	image(t, filepath.Join(runners, "old-1"), 116*mb, 4*mb) // claims 112 MiB
	image(t, filepath.Join(runners, ".template-2147483648"), 2048*mb, mb)
	image(t, filepath.Join(runners, ".ready-1"), 2048*mb, mb)
	// 64 MiB floor, 112 MiB claimed: 24 MiB left, 12 the half: the least.
	d := &Dirs{Size: DefaultSize, Statfs: fakeSpace(200*mb, 640*mb)}
	release, err := d.Reserve(filepath.Join(runners, "new-1"))
	if err != nil {
		t.Fatal(err)
	}
	if got := d.booked[filepath.Join(runners, "new-1")].size; got != DefaultMinSize {
		t.Fatalf("booked %d, want the least, %d", got, DefaultMinSize)
	}
	// 8 MiB left: refused, and said so without a path.
	_, err = d.Reserve(filepath.Join(runners, "new-2"))
	var nr *NoRoomError
	fi, _ := os.Stat(imagePath(filepath.Join(runners, "old-1")))
	oldClaim := fi.Size() - fi.Sys().(*syscall.Stat_t).Blocks*512 // 112 MiB where nothing more is allocated
	if !errors.As(err, &nr) || nr.Free != 200*mb || nr.Floor != 64*mb || nr.Claimed != oldClaim+DefaultMinSize {
		t.Fatalf("second reserve: %#v", err)
	}
	if msg := err.Error(); !strings.Contains(msg, "has 200 MiB free") || !strings.Contains(msg, "at least 16 MiB") || strings.Contains(msg, runners) {
		t.Fatalf("message: %s", msg)
	}
	if _, ok := d.booked[filepath.Join(runners, "new-2")]; ok {
		t.Fatal("a refused reserve is booked")
	}
	// Released, its room is there again.
	release()
	release()
	if _, err := d.Reserve(filepath.Join(runners, "new-2")); err != nil {
		t.Fatalf("after release: %v", err)
	}
}

// Concurrent submits never count on the same room: what they book
// together fits above the floor.
func TestConcurrentReservesShareTheRoom(t *testing.T) {
	runners := filepath.Join(t.TempDir(), "runners")
	sp := Space{Free: 1 << 30, Total: 2 << 30}
	d := &Dirs{Size: DefaultSize, Statfs: fakeSpace(sp.Free, sp.Total)}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var admitted, refused int
	for i := range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := d.Reserve(filepath.Join(runners, "task-"+strconv.Itoa(i)))
			mu.Lock()
			defer mu.Unlock()
			if err == nil {
				admitted++
			} else if errors.Is(err, ErrNoRoom) {
				refused++
			} else {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	var total int64
	for _, b := range d.booked {
		total += b.size
	}
	if room := sp.Free - Floor(sp.Total); total > room || admitted+refused != 32 || refused == 0 || admitted < 2 {
		t.Fatalf("booked %d of a room of %d: %d admitted, %d refused", total, room, admitted, refused)
	}
	t.Logf("%d admitted (%d bytes), %d refused", admitted, total, refused)
}

// Make sizes the image as its booking said, shrinks it when the room went
// since, and fails without a dir of its own, nor an unbounded one, when
// nothing is left. The configured size on a roomy disk is the template's.
func TestMakeSizesTheImageToTheRoom(t *testing.T) {
	d, dir := dirs(t, DefaultSize)
	free := int64(300 * mb)
	d.Statfs = func(string) (Space, error) { return Space{Free: free, Total: 640 * mb}, nil }
	// 300 - 64 floor = 236 left: 118 MiB.
	release, err := d.Reserve(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	free = 200 * mb // something else took 100 MiB since: 136 left
	if err := d.Make(context.Background(), dir); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(imagePath(dir))
	if err != nil || fi.Size() != 118*mb || !d.mounted(dir) {
		t.Fatalf("image: %v %v mounted %v", fi.Size(), err, d.mounted(dir))
	}
	if len(d.booked) != 0 {
		t.Fatalf("still booked after Make: %v", d.booked)
	}
	// Its claim (118 MiB less the few hundred KiB it holds) now counts
	// from the disk: of 130 MiB above the floor, what is left is under
	// the least.
	free = 64*mb + 130*mb
	second := filepath.Join(filepath.Dir(dir), "task-2")
	t.Cleanup(func() { _ = d.Remove(second) })
	err = d.Make(context.Background(), second)
	if !errors.Is(err, ErrNoRoom) {
		t.Fatalf("make with no room: %v", err)
	}
	if _, serr := os.Stat(imagePath(second)); !os.IsNotExist(serr) {
		t.Fatalf("an image was made: %v", serr)
	}
	if _, serr := os.Stat(second); !os.IsNotExist(serr) {
		t.Fatalf("an unbounded dir was made: %v", serr)
	}
	if n, err := fill(t, dir); err == nil || n > 118*mb {
		t.Fatalf("wrote %d bytes: %v", n, err)
	}
	if err := d.Remove(dir); err != nil {
		t.Fatal(err)
	}
	// Roomy again: the configured size, a copy of the template.
	free = 100 << 30
	if err := d.Make(context.Background(), second); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(imagePath(second)); err != nil || fi.Size() != DefaultSize {
		t.Fatalf("image on a roomy disk: %v", err)
	}
	if _, err := os.Stat(d.templatePath(filepath.Dir(dir))); err != nil {
		t.Fatalf("no template: %v", err)
	}
}
