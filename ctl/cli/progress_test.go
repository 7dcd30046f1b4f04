package cli

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/ctl"
)

func TestProgressPrinter(t *testing.T) {
	pull := ctl.Event{Kind: ctl.EventPull, Task: "abcd1234", Image: "img", Pull: &api.ImagePullProgress{DownloadedBytes: 1 << 20, TotalBytes: 4 << 20, IsTotalBytesFinal: true}}
	ready := ctl.Event{Kind: ctl.EventReady, Task: "abcd1234", Status: api.TaskRunning, Took: 1500 * time.Millisecond}
	left := ctl.Event{Kind: ctl.EventTaskLeft, Task: "abcd1234", Name: "train", Shim: "10.0.0.2:10998", Err: errors.New("terminate: timeout")}
	leftNode := left
	leftNode.Node = "node 1 (gpu-b)"
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
		{"quiet shows only a task left behind, with how to remove it", false, true, []ctl.Event{pull, ready, left},
			"tandem: task abcd1234 was left on the shim: terminate: timeout\nremove it with: tandem rm -f --shim 10.0.0.2:10998 train\n"},
		{"a node's task left behind names the node", false, false, []ctl.Event{leftNode},
			"tandem: node 1 (gpu-b): task abcd1234 was left on the shim: terminate: timeout\nremove it with: tandem rm -f --shim 10.0.0.2:10998 train\n"},
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

func TestProgressBar(t *testing.T) {
	for _, tc := range []struct {
		done, total int64
		final       bool
		want        string
	}{
		{0, 40 << 20, true, "[------------------------] 0/40 MiB"},
		{10 << 20, 40 << 20, false, "[######------------------] 10/40+ MiB"},
		{40 << 20, 40 << 20, true, "[########################] 40/40 MiB"},
		{50 << 20, 40 << 20, true, "[########################] 50/40 MiB"},
	} {
		if got := progressBar(tc.done, tc.total, tc.final); got != tc.want {
			t.Errorf("progressBar(%d, %d) = %q want %q", tc.done, tc.total, got, tc.want)
		}
	}
}
