package cli

import (
	"bytes"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/ctl"
)

func TestProgressPrinter(t *testing.T) {
	pull := ctl.Event{Kind: ctl.EventPull, Task: "abcd1234", Image: "img", Pull: &api.ImagePullProgress{DownloadedBytes: 1 << 20, TotalBytes: 4 << 20, IsTotalBytesFinal: true}}
	ready := ctl.Event{Kind: ctl.EventReady, Task: "abcd1234", Status: api.TaskRunning, Took: 1500 * time.Millisecond}
	notice := ctl.Event{Kind: ctl.EventNotice, Text: "tandem: task left"}
	tests := []struct {
		name       string
		tty, quiet bool
		events     []ctl.Event
		want       string
	}{
		{"terminal redraws the pull, then ends its line", true, false, []ctl.Event{pull, pull, ready},
			"\r\x1b[K  pulling img: [######------------------] 1/4 MiB\r\x1b[K  pulling img: [######------------------] 1/4 MiB\ntask abcd1234: running after 1.50s\n"},
		{"a log gets one pull line per 5 s", false, false, []ctl.Event{pull, pull, ready},
			"  pulling img: [######------------------] 1/4 MiB\ntask abcd1234: running after 1.50s\n"},
		{"several runs at once: no redrawing", true, false, []ctl.Event{func() ctl.Event { e := pull; e.Concurrent = true; return e }()},
			"  pulling img: [######------------------] 1/4 MiB\n"},
		{"quiet shows notices only", false, true, []ctl.Event{pull, ready, notice}, "tandem: task left\n"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var b bytes.Buffer
			p := &progressPrinter{w: &b, tty: tc.tty, quiet: tc.quiet}
			for _, e := range tc.events {
				p.event(e)
			}
			if b.String() != tc.want {
				t.Errorf("got %q\nwant %q", b.String(), tc.want)
			}
		})
	}
}
