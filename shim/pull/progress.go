// Package pull owns image pulls: reading Docker's JSON progress stream into
// per-layer byte counts, the aggregate the shim reports as
// image_pull_progress, and the stall detection that replaces a fixed timeout.
package pull

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"time"

	"github.com/tandem-run/tandem/api"
)

// event is one line of Docker's pull stream.
type event struct {
	ID             string `json:"id"`
	Status         string `json:"status"`
	ProgressDetail struct {
		Current int64  `json:"current"`
		Total   int64  `json:"total"`
		Units   string `json:"units"`
	} `json:"progressDetail"`
	Error       string `json:"error"`
	ErrorDetail *struct {
		Message string `json:"message"`
	} `json:"errorDetail"`
}

type layer struct {
	status                       string
	downloaded, extracted, total int64
}

// Tracker aggregates the progress of one pull. It is safe for concurrent use:
// the pull goroutine feeds it while API handlers read snapshots.
type Tracker struct {
	now func() time.Time

	mu           sync.Mutex // guards the fields below
	layers       map[string]*layer
	order        []string
	errs         []string
	lastProgress time.Time
	started      time.Time
	seen         bool
}

// NewTracker returns an empty tracker using now as its clock.
func NewTracker(now func() time.Time) *Tracker {
	t := now()
	return &Tracker{now: now, layers: map[string]*layer{}, lastProgress: t, started: t}
}

// Feed reads the stream to its end, tee-ing raw lines into log (may be nil).
// It returns the errors Docker reported in the stream, or a read error.
func (t *Tracker) Feed(r io.Reader, log io.Writer) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		line := sc.Bytes()
		if log != nil {
			_, _ = log.Write(append(line, '\n'))
		}
		var ev event
		if err := json.Unmarshal(line, &ev); err != nil {
			continue // not our business: Docker owns the stream format
		}
		t.apply(ev)
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("read pull stream: %w", err)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.errs) > 0 {
		return errors.New(strings.Join(t.errs, "; "))
	}
	return nil
}

func (t *Tracker) apply(ev event) {
	t.mu.Lock()
	defer t.mu.Unlock()
	// Any event at all shows the daemon is alive; byte counts are checked below.
	if ev.ErrorDetail != nil || ev.Error != "" {
		msg := ev.Error
		if ev.ErrorDetail != nil && ev.ErrorDetail.Message != "" {
			msg = ev.ErrorDetail.Message
		}
		t.errs = append(t.errs, msg)
		return
	}
	if ev.ID == "" {
		return
	}
	l, ok := t.layers[ev.ID]
	if !ok {
		if !isLayerStatus(ev.Status) {
			return // e.g. "latest: Pulling from library/x" carries the tag as id
		}
		l = &layer{}
		t.layers[ev.ID] = l
		t.order = append(t.order, ev.ID)
	}
	t.seen = true
	before := l.downloaded + l.extracted
	bytesUnit := ev.ProgressDetail.Units == "" || ev.ProgressDetail.Units == "bytes"
	switch ev.Status {
	case "Downloading":
		if bytesUnit {
			l.downloaded, l.total = ev.ProgressDetail.Current, ev.ProgressDetail.Total
		}
	case "Download complete":
		l.downloaded = l.total
	case "Extracting":
		if bytesUnit {
			l.extracted = ev.ProgressDetail.Current
			l.total = ev.ProgressDetail.Total
			l.downloaded = l.total
		}
	case "Pull complete":
		l.downloaded, l.extracted = l.total, l.total
	}
	l.status = ev.Status
	if l.downloaded+l.extracted != before || ev.Status == "Pull complete" || ev.Status == "Already exists" || ev.Status == "Verifying Checksum" {
		t.lastProgress = t.now()
	}
}

func isLayerStatus(s string) bool {
	switch s {
	case "Pulling fs layer", "Waiting", "Downloading", "Verifying Checksum", "Download complete",
		"Extracting", "Pull complete", "Already exists", "Retrying":
		return true
	}
	return strings.HasPrefix(s, "Retrying")
}

// Progress returns the aggregate, or nil before the first layer event.
func (t *Tracker) Progress() *api.ImagePullProgress {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.seen {
		return nil
	}
	p := &api.ImagePullProgress{IsTotalBytesFinal: true}
	for _, id := range t.order {
		l := t.layers[id]
		p.DownloadedBytes += l.downloaded
		p.ExtractedBytes += l.extracted
		p.TotalBytes += l.total
		if l.total == 0 && l.status != "Already exists" && l.status != "Pull complete" {
			p.IsTotalBytesFinal = false
		}
	}
	return p
}

// SinceProgress is how long no byte has moved.
func (t *Tracker) SinceProgress() time.Duration {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.now().Sub(t.lastProgress)
}

// Summary is a one-line account for error messages.
func (t *Tracker) Summary() string {
	p := t.Progress()
	t.mu.Lock()
	elapsed := t.now().Sub(t.started)
	t.mu.Unlock()
	if p == nil {
		return fmt.Sprintf("no layer progress after %s", elapsed.Round(time.Second))
	}
	speed := float64(p.DownloadedBytes) / max(elapsed.Seconds(), 0.001)
	return fmt.Sprintf("downloaded %d/%d bytes (%s/s)", p.DownloadedBytes, p.TotalBytes, humanBytes(speed))
}

func humanBytes(b float64) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB"}
	i := 0
	for b >= 1024 && i < len(units)-1 {
		b /= 1024
		i++
	}
	return fmt.Sprintf("%.1f %s", b, units[i])
}
