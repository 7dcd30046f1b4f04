package fastpull

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/shim/pull"
)

func digestOf(b []byte) string {
	s := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(s[:])
}

func TestInflate(t *testing.T) {
	tarBytes := bytes.Repeat([]byte("layer tar bytes "), 4096)
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write(tarBytes)
	zw.Close()
	blob := gz.Bytes()
	pigz, _ := exec.LookPath("pigz")
	for _, c := range []struct {
		name            string
		blob            []byte
		digest, diffID  string
		gzipped         bool
		pigz            string
		budget          int64
		wantErr         error
		wantErrContains string
	}{
		{name: "gzip", blob: blob, digest: digestOf(blob), diffID: digestOf(tarBytes), gzipped: true, budget: 1 << 20},
		{name: "pigz", blob: blob, digest: digestOf(blob), diffID: digestOf(tarBytes), gzipped: true, pigz: pigz, budget: 1 << 20},
		{name: "plain tar", blob: tarBytes, digest: digestOf(tarBytes), diffID: digestOf(tarBytes), budget: 1 << 20},
		{name: "wrong blob digest", blob: blob, digest: digestOf(tarBytes), diffID: digestOf(tarBytes), gzipped: true, budget: 1 << 20, wantErr: errDigest},
		{name: "wrong diff_id", blob: blob, digest: digestOf(blob), diffID: digestOf(blob), gzipped: true, budget: 1 << 20, wantErr: errDigest},
		{name: "not gzip", blob: tarBytes, digest: digestOf(tarBytes), diffID: digestOf(tarBytes), gzipped: true, budget: 1 << 20, wantErrContains: "gunzip"},
		{name: "over budget", blob: blob, digest: digestOf(blob), diffID: digestOf(tarBytes), gzipped: true, budget: 1000, wantErr: errBudget},
	} {
		if c.name == "pigz" && pigz == "" {
			continue
		}
		dir := t.TempDir()
		src := filepath.Join(dir, "blob")
		os.WriteFile(src, c.blob, 0o600)
		in, _ := os.Open(src)
		out, _ := os.Create(filepath.Join(dir, "tar"))
		left := c.budget
		var moved int64
		err := inflate(context.Background(), in, out, c.digest, c.diffID, c.gzipped, c.pigz, func(n int64) error {
			if left -= n; left < 0 {
				return errBudget
			}
			return nil
		}, func(n int64) { moved += n })
		in.Close()
		out.Close()
		switch {
		case c.wantErr != nil:
			if !errors.Is(err, c.wantErr) {
				t.Errorf("%s: %v, want %v", c.name, err, c.wantErr)
			}
		case c.wantErrContains != "":
			if err == nil || !strings.Contains(err.Error(), c.wantErrContains) {
				t.Errorf("%s: %v, want %q", c.name, err, c.wantErrContains)
			}
		default:
			got, _ := os.ReadFile(out.Name())
			if err != nil || !bytes.Equal(got, tarBytes) || moved != int64(len(c.blob)) {
				t.Errorf("%s: %v, %d bytes, moved %d of %d", c.name, err, len(got), moved, len(c.blob))
			}
		}
	}
}

// The fast path's stream reads, in shim/pull's tracker, as Docker's does:
// totals final, every byte down, and a reader that joins late (a second
// task of the same image) reads it from the start.
func TestProgressStreamReadsAsDockers(t *testing.T) {
	h := newHub()
	p := newProgress(h, time.Now)
	p.status("v1", "Pulling from x")
	p.status("aaaaaaaaaaaa", "Already exists")
	p.status("bbbbbbbbbbbb", "Pulling fs layer")
	p.count("bbbbbbbbbbbb", "Downloading", 0, 100, true)
	p.count("bbbbbbbbbbbb", "Downloading", 60, 100, true)
	first := pull.NewTracker(time.Now)
	done := make(chan error, 1)
	go func() { done <- first.Feed(&reader{ctx: context.Background(), h: h, leave: func() {}}, nil) }()
	p.count("bbbbbbbbbbbb", "Downloading", 100, 100, true)
	p.status("bbbbbbbbbbbb", "Download complete")
	p.count("bbbbbbbbbbbb", "Extracting", 100, 100, true)
	p.status("bbbbbbbbbbbb", "Pull complete")
	h.close(nil)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	late := pull.NewTracker(time.Now)
	if err := late.Feed(&reader{ctx: context.Background(), h: h, leave: func() {}}, nil); err != nil {
		t.Fatal(err)
	}
	for _, tr := range []*pull.Tracker{first, late} {
		got := tr.Progress()
		if got == nil || got.TotalBytes != 100 || got.DownloadedBytes != 100 || got.ExtractedBytes != 100 || !got.IsTotalBytesFinal {
			t.Fatalf("progress %+v", got)
		}
	}
	// A reader whose task is gone stops at once, the pull going on.
	ctx, cancel := context.WithCancel(context.Background())
	h2 := newHub()
	cancel()
	if _, err := (&reader{ctx: ctx, h: h2, leave: func() {}}).Read(make([]byte, 10)); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled reader: %v", err)
	}
}
