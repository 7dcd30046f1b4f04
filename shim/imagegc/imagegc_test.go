package imagegc

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/image"
)

// fakeHost is a Docker whose images take their size of a disk: removing
// one frees it.
type fakeHost struct {
	total      uint64
	other      uint64 // what is not images
	images     []Image
	containers []string // image IDs
	refuse     map[string]bool
	removed    []string
}

func (f *fakeHost) Usage(string) (Usage, error) {
	used := f.other
	for _, i := range f.images {
		used += uint64(i.Size)
	}
	return Usage{Total: f.total, Free: f.total - used}, nil
}

func (f *fakeHost) Images(context.Context) ([]Image, error) { return slices.Clone(f.images), nil }
func (f *fakeHost) ContainerImageIDs(context.Context) ([]string, error) {
	return slices.Clone(f.containers), nil
}

func (f *fakeHost) RemoveImage(_ context.Context, img Image) error {
	if f.refuse[img.ID] {
		return errors.New("conflict: image is being used by a container made meanwhile")
	}
	f.images = slices.DeleteFunc(f.images, func(i Image) bool { return i.ID == img.ID })
	f.removed = append(f.removed, img.ID)
	return nil
}

type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

func collector(h *fakeHost, c *clock, p Policy) *Collector {
	return &Collector{Policy: p, Disk: h, Engine: h, Path: "/var/lib/docker", Now: c.now, Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
}

const gb = 1 << 30

func img(id string, size int64, tags ...string) Image {
	return Image{ID: "sha256:" + id, RepoTags: tags, Size: size, Pulled: true}
}

func TestCollectBelowHighRemovesNothing(t *testing.T) {
	h := &fakeHost{total: 100 * gb, other: 50 * gb, images: []Image{img("a1", 30*gb, "a:1")}} // 80%
	c := &clock{t: time.Unix(1e9, 0)}
	gc := collector(h, c, DefaultPolicy())
	if _, err := gc.Collect(context.Background()); err != nil {
		t.Fatal(err)
	}
	c.t = c.t.Add(time.Hour)
	rep, err := gc.Collect(context.Background())
	if err != nil || len(h.removed) != 0 || rep.Before != 80 {
		t.Fatalf("below 85%%: %+v %v removed %v", rep, err, h.removed)
	}
}

// Above 85%: least recently used first, down to 80% and no further;
// nothing in use, kept, wanted by a task, or too young goes.
func TestCollectFreesDownToLowLeastRecentlyUsedFirst(t *testing.T) {
	h := &fakeHost{total: 100 * gb, other: 40 * gb}
	h.images = []Image{
		img("used0000000000", 5*gb, "job:running"),
		img("old00000000000", 5*gb, "old:1"),
		img("recent00000000", 5*gb, "recent:1"),
		img("kepttag0000000", 5*gb, "ubuntu:latest"),
		img("keptid00000000abcdef", 5*gb, "keptbyid:1"),
		img("hub00000000000", 5*gb, "pytorch/pytorch:2.3"),
		img("task0000000000", 5*gb, "10.0.0.5:5000/team/train:v3"),
		img("spare000000000", 5*gb), // dangling
	}
	c := &clock{t: time.Unix(1e9, 0)}
	p := DefaultPolicy()
	p.Keep = []string{"ubuntu", "sha256:keptid00000000", "docker.io/pytorch/pytorch:2.3"}
	gc := collector(h, c, p)
	gc.Tasks = func() []string { return []string{"10.0.0.5:5000/team/train:v3"} }
	// recent was used by a container an hour in, then its container went.
	h.containers = []string{"sha256:used0000000000"}
	if _, err := gc.Collect(context.Background()); err != nil {
		t.Fatal(err)
	}
	c.t = c.t.Add(time.Hour)
	h.containers = []string{"sha256:used0000000000", "sha256:recent00000000"}
	h.images = append(h.images, img("young000000000", 5*gb, "young:1")) // 85%: seen now
	rep, err := gc.Collect(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	// Candidates: old and spare (never used, seen at 0); recent and used
	// have containers, young is under two minutes old, the rest are kept
	// or a task's. 85% -> 80% takes one, in listing order on a tie.
	if want := []string{"sha256:old00000000000"}; !slices.Equal(h.removed, want) || rep.Before != 85 || rep.After != 80 {
		t.Fatalf("removed %v (want %v), %+v", h.removed, want, rep)
	}
	c.t = c.t.Add(time.Minute)
	h.containers = []string{"sha256:used0000000000"}
	h.images = append(h.images, img("big00000000000", 5*gb, "big:1")) // 85% again, seen now
	if rep, err = gc.Collect(context.Background()); err != nil {
		t.Fatal(err)
	}
	// spare (last use: first seen, at 0) before recent (used at 1h).
	if want := []string{"sha256:old00000000000", "sha256:spare000000000"}; !slices.Equal(h.removed, want) || rep.After != 80 {
		t.Fatalf("removed %v (want %v), %+v", h.removed, want, rep)
	}
	c.t = c.t.Add(time.Minute)
	h.images = append(h.images, img("big20000000000", 5*gb, "big:2"))
	if rep, err = gc.Collect(context.Background()); err != nil {
		t.Fatal(err)
	}
	if want := "sha256:recent00000000"; h.removed[len(h.removed)-1] != want || rep.After != 80 {
		t.Fatalf("removed %v (want %s last), %+v", h.removed, want, rep)
	}
}

func TestCollectGoesOnPastARefusalAndSaysWhenItCannotReachLow(t *testing.T) {
	h := &fakeHost{total: 100 * gb, other: 80 * gb, refuse: map[string]bool{"sha256:a": true},
		images: []Image{img("a", 6*gb, "a:1"), img("b", 4*gb, "b:1"), img("c", 5*gb, "c:1")}} // 95%
	c := &clock{t: time.Unix(1e9, 0)}
	gc := collector(h, c, DefaultPolicy())
	if _, err := gc.Collect(context.Background()); err != nil {
		t.Fatal(err)
	}
	c.t = c.t.Add(time.Hour)
	rep, err := gc.Collect(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	// Same last use: biggest first; a is refused, then c and b go and 80%
	// of the other things is what is left.
	if want := []string{"sha256:c", "sha256:b"}; !slices.Equal(h.removed, want) || rep.After != 86 {
		t.Fatalf("removed %v (want %v), %+v", h.removed, want, rep)
	}
}

func TestPolicyValidate(t *testing.T) {
	for _, c := range []struct {
		p  Policy
		ok bool
	}{
		{DefaultPolicy(), true},
		{Policy{HighPercent: 100, LowPercent: 99}, true},
		{Policy{HighPercent: 80, LowPercent: 85}, false},
		{Policy{HighPercent: 85, LowPercent: 85}, false},
		{Policy{HighPercent: 0, LowPercent: 0}, false},
		{Policy{HighPercent: 101, LowPercent: 80}, false},
		{Policy{HighPercent: 85, LowPercent: -1}, false},
		{Policy{HighPercent: 85, LowPercent: 80, MinAge: -time.Second}, false},
	} {
		if err := c.p.Validate(); (err == nil) != c.ok {
			t.Errorf("%+v: %v", c.p, err)
		}
	}
}

func TestMatches(t *testing.T) {
	i := img("0123456789abcdef", 1, "ubuntu:latest", "nvcr.io/nvidia/pytorch:24.05-py3")
	for ref, want := range map[string]bool{
		"ubuntu": true, "docker.io/library/ubuntu": true, "ubuntu:22.04": false, "nvcr.io/nvidia/pytorch:24.05-py3": true,
		"nvcr.io/nvidia/pytorch": false, "sha256:0123456789ab": true, "0123456789ab": true, "0123456": false,
		"localhost:5000/x": false, "": false,
	} {
		if got := matches(i, []string{ref}); got != want {
			t.Errorf("%q: %v", ref, got)
		}
	}
	// A registry with a port and no tag is :latest.
	if !matches(img("1", 1, "localhost:5000/x:latest"), []string{"localhost:5000/x"}) {
		t.Error("host:port/name means :latest")
	}
}

// fakeAPI records the Docker calls of the adapter.
type fakeAPI struct{ removed []string }

func (f *fakeAPI) ImageList(context.Context, image.ListOptions) ([]image.Summary, error) {
	return []image.Summary{{ID: "sha256:a", RepoTags: []string{"a:1", "a:2"}, Size: 7}, {ID: "sha256:b", RepoTags: []string{"<none>:<none>"}}}, nil
}

func (f *fakeAPI) ContainerList(context.Context, container.ListOptions) ([]container.Summary, error) {
	return []container.Summary{{ImageID: "sha256:a"}}, nil
}

func (f *fakeAPI) ImageRemove(_ context.Context, ref string, o image.RemoveOptions) ([]image.DeleteResponse, error) {
	if o.Force {
		return nil, errors.New("forced")
	}
	f.removed = append(f.removed, ref)
	return nil, nil
}

func TestDockerAdapterUntagsEachTagUnforced(t *testing.T) {
	api := &fakeAPI{}
	d := Docker{API: api}
	imgs, err := d.Images(context.Background())
	if err != nil || len(imgs) != 2 || len(imgs[1].RepoTags) != 0 || imgs[0].Size != 7 {
		t.Fatalf("%+v %v", imgs, err)
	}
	for _, i := range imgs {
		if err := d.RemoveImage(context.Background(), i); err != nil {
			t.Fatal(err)
		}
	}
	if want := []string{"a:1", "a:2", "sha256:b"}; !slices.Equal(api.removed, want) {
		t.Fatalf("removed %v, want %v", api.removed, want)
	}
}

// TestOnlyImagesThatCanComeBack: an image no registry holds and the shim
// did not load (one built or loaded on the host) stays however full the
// disk; one the shim's ledger names may go.
func TestOnlyImagesThatCanComeBack(t *testing.T) {
	built := Image{ID: "sha256:built", RepoTags: []string{"mine:1"}, Size: 20 * gb}
	loaded := Image{ID: "sha256:loaded", RepoTags: []string{"fast:1"}, Size: 20 * gb}
	h := &fakeHost{total: 100 * gb, other: 50 * gb, images: []Image{built, loaded}} // 90%
	c := &clock{t: time.Unix(1e9, 0)}
	gc := collector(h, c, Policy{HighPercent: 85, LowPercent: 10})
	l := &Ledger{Path: t.TempDir() + "/ledger"}
	gc.Ours = l.IDs
	if rep, err := gc.Collect(context.Background()); err != nil || len(rep.Removed) != 0 {
		t.Fatalf("nothing may go yet: %+v %v", rep, err)
	}
	if err := l.Add(loaded.ID); err != nil {
		t.Fatal(err)
	}
	if err := l.Add(loaded.ID); err != nil { // once
		t.Fatal(err)
	}
	if err := l.Add("not-an-id\n"); err == nil {
		t.Fatal("a line that is no image ID went into the ledger")
	}
	rep, err := gc.Collect(context.Background())
	if err != nil || !slices.Equal(rep.Removed, []string{loaded.ID}) {
		t.Fatalf("want only the shim's own image removed: %+v %v", rep, err)
	}
	if ids, _ := l.IDs(); len(ids) != 1 {
		t.Fatalf("ledger %v", ids)
	}
}
