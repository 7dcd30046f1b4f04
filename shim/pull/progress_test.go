package pull

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

const stream = `{"status":"Pulling from library/busybox","id":"latest"}
{"status":"Pulling fs layer","progressDetail":{},"id":"aaa"}
{"status":"Already exists","progressDetail":{},"id":"bbb"}
{"status":"Waiting","progressDetail":{},"id":"ccc"}
{"status":"Downloading","progressDetail":{"current":100,"total":1000},"progress":"[>  ]","id":"aaa"}
{"status":"Downloading","progressDetail":{"current":500,"total":1000},"id":"aaa"}
{"status":"Verifying Checksum","progressDetail":{},"id":"aaa"}
{"status":"Download complete","progressDetail":{},"id":"aaa"}
{"status":"Extracting","progressDetail":{"current":300,"total":1000},"id":"aaa"}
not json at all
{"status":"Pull complete","progressDetail":{},"id":"aaa"}
{"status":"Digest: sha256:abc"}
{"status":"Status: Downloaded newer image for busybox:latest"}
`

func TestTrackerAggregates(t *testing.T) {
	c := &clock{t: time.Unix(1000, 0)}
	tr := NewTracker(c.now)
	if tr.Progress() != nil {
		t.Fatal("progress must be null before the first layer event")
	}
	var log bytes.Buffer
	if err := tr.Feed(strings.NewReader(stream), &log); err != nil {
		t.Fatalf("feed: %v", err)
	}
	if log.String() != stream {
		t.Fatalf("raw stream must be tee'd verbatim")
	}
	p := tr.Progress()
	if p.DownloadedBytes != 1000 || p.ExtractedBytes != 1000 || p.TotalBytes != 1000 {
		t.Fatalf("aggregate %+v", p)
	}
	// ccc stayed Waiting with total 0: the total is not final.
	if p.IsTotalBytesFinal {
		t.Fatal("a waiting layer with unknown size makes the total not final")
	}
}

func TestTrackerErrorsAndStall(t *testing.T) {
	c := &clock{t: time.Unix(1000, 0)}
	tr := NewTracker(c.now)
	c.t = c.t.Add(90 * time.Second)
	if got := tr.SinceProgress(); got != 90*time.Second {
		t.Fatalf("stall clock %v", got)
	}
	err := tr.Feed(strings.NewReader(`{"status":"Downloading","progressDetail":{"current":5,"total":10},"id":"x"}
{"errorDetail":{"message":"unauthorized: authentication required"},"error":"unauthorized: authentication required"}
`), nil)
	if err == nil || !strings.Contains(err.Error(), "unauthorized") {
		t.Fatalf("stream errors must surface: %v", err)
	}
	if tr.SinceProgress() != 0 {
		t.Fatal("bytes moving resets the stall clock")
	}
	if s := tr.Summary(); !strings.Contains(s, "downloaded 5/10 bytes") {
		t.Fatalf("summary %q", s)
	}
}

func FuzzTrackerFeed(f *testing.F) {
	f.Add([]byte(stream))
	f.Fuzz(func(t *testing.T, b []byte) {
		tr := NewTracker(time.Now)
		// The stream comes from the daemon, possibly a registry's words in it:
		// whatever it holds, feeding and reporting must not panic.
		_ = tr.Feed(bytes.NewReader(b), nil)
		_ = tr.Progress()
		_ = tr.Summary()
	})
}
