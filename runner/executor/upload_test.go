package executor

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tandem-run/tandem/api"
)

// failingReader gives its text, then a broken connection.
type failingReader struct{ r io.Reader }

func (f failingReader) Read(p []byte) (int, error) {
	n, err := f.r.Read(p)
	if errors.Is(err, io.EOF) {
		return n, errors.New("connection reset by peer")
	}
	return n, err
}

// A retried upload lands whole or not at all: one that breaks off or is
// too large leaves the one before as it was (it cut it to nothing), and of
// two that overlap the last to arrive whole is kept, never a mix.
func TestRetriedUploadsLandWhole(t *testing.T) {
	tmp := t.TempDir()
	x, err := New(Config{TempDir: tmp, MaxUpload: 100})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { x.Close() })
	wd := t.TempDir()
	if err := x.Submit(api.SubmitBody{Run: api.Run{RunSpec: api.RunSpec{RepoID: "repo"}},
		JobSpec: api.JobSpec{Commands: []string{"true"}, WorkingDir: &wd, RepoDir: &wd}}); err != nil {
		t.Fatal(err)
	}
	blobs := filepath.Join(tmp, "repo_blobs")
	// stored is the upload in place; parts says how many are arriving.
	stored := func(parts int) string {
		t.Helper()
		entries, err := os.ReadDir(blobs)
		if err != nil || len(entries) != 1+parts {
			t.Fatalf("uploads on disk: %v %v", entries, err)
		}
		name := ""
		for _, e := range entries {
			if !strings.HasPrefix(e.Name(), ".") {
				name = e.Name()
			}
		}
		b, err := os.ReadFile(filepath.Join(blobs, name))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	if err := x.UploadCode(strings.NewReader("first, whole")); err != nil {
		t.Fatal(err)
	}
	if err := x.UploadCode(failingReader{strings.NewReader("a retry cut")}); !errors.Is(err, ErrBadInput) {
		t.Fatalf("a broken upload: %v", err)
	}
	if got := stored(0); got != "first, whole" {
		t.Fatalf("after a broken retry: %q", got)
	}
	if err := x.UploadCode(strings.NewReader(strings.Repeat("x", 101))); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("a retry over the limit: %v", err)
	}
	if got := stored(0); got != "first, whole" {
		t.Fatalf("after a retry over the limit: %q", got)
	}
	// Two at once: the first still arriving when the second lands.
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() { done <- x.UploadCode(pr) }()
	if _, err := pw.Write([]byte("AAAA")); err != nil {
		t.Fatal(err)
	}
	if err := x.UploadCode(strings.NewReader("BBBBBBBB")); err != nil {
		t.Fatal(err)
	}
	if got := stored(1); got != "BBBBBBBB" {
		t.Fatalf("the second of two: %q", got)
	}
	_, _ = pw.Write([]byte("AAAA"))
	pw.Close()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got := stored(0); got != "AAAAAAAA" {
		t.Fatalf("the last to arrive whole: %q", got)
	}
}
