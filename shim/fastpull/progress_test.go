package fastpull

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/shim/pull"
)

func digestOf(b []byte) string {
	s := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(s[:])
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

// Docker's pull from the loopback registry, relayed: its layer lines but
// "Downloading" (the fetcher's stand there), none that names the loopback
// registry, and an error in its stream is the fast path's, not relayed.
func TestRelayPull(t *testing.T) {
	ids := map[string]bool{"bbbbbbbbbbbb": true}
	stream := strings.Join([]string{
		`{"status":"Pulling from tandem-fastpull/0123","id":"v1"}`,
		`{"status":"Pulling fs layer","progressDetail":{},"id":"bbbbbbbbbbbb"}`,
		`{"status":"Downloading","progressDetail":{"current":5,"total":100},"id":"bbbbbbbbbbbb"}`,
		`not json`,
		`{"status":"Extracting","progressDetail":{"current":50,"total":100},"id":"bbbbbbbbbbbb"}`,
		`{"status":"Pull complete","progressDetail":{},"id":"bbbbbbbbbbbb"}`,
		`{"status":"Digest: sha256:00"}`,
		`{"status":"Status: Downloaded newer image for 127.0.0.1:1/tandem-fastpull/0123:v1"}`,
	}, "\n") + "\n"
	h := newHub()
	if err := relayPull(strings.NewReader(stream), ids, h); err != nil {
		t.Fatal(err)
	}
	h.close(nil)
	var got []string
	for _, l := range h.lines {
		got = append(got, strings.TrimSpace(string(l)))
	}
	want := []string{
		`{"status":"Pulling fs layer","progressDetail":{},"id":"bbbbbbbbbbbb"}`,
		`{"status":"Extracting","progressDetail":{"current":50,"total":100},"id":"bbbbbbbbbbbb"}`,
		`{"status":"Pull complete","progressDetail":{},"id":"bbbbbbbbbbbb"}`,
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("relayed:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}

	h = newHub()
	err := relayPull(strings.NewReader(`{"status":"Extracting","progressDetail":{"current":1,"total":2},"id":"bbbbbbbbbbbb"}`+"\n"+
		`{"errorDetail":{"message":"unexpected EOF"},"error":"unexpected EOF"}`+"\n"), ids, h)
	if err == nil || !strings.Contains(err.Error(), "unexpected EOF") {
		t.Fatalf("an error in Docker's stream: %v", err)
	}
	for _, l := range h.lines {
		if strings.Contains(string(l), "error") {
			t.Fatalf("the error was relayed: %s", l)
		}
	}
}
