package executor

import (
	"errors"
	"strings"
	"testing"

	"github.com/tandem-run/tandem/api"
)

// TestResizeBeforeStart: a resize that comes before the job starts is
// the size its terminal starts with; one out of bounds is refused as bad
// input, and before a submit there is no job to resize.
func TestResizeBeforeStart(t *testing.T) {
	x, err := New(Config{TempDir: t.TempDir()}) // a pull takes the whole output
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { x.Close() })
	if err := x.Resize(api.TermSize{Rows: 30, Cols: 100}); !errors.Is(err, ErrState) {
		t.Fatalf("resize before a submit: %v", err)
	}
	wd := t.TempDir()
	if err := x.Submit(api.SubmitBody{JobSpec: api.JobSpec{Commands: []string{"sh", "-c", "stty size </dev/tty"}, WorkingDir: &wd, RepoDir: &wd},
		Tandem: &api.SubmitExtras{Stdin: api.StdinNone, TTY: &api.TermSize{Rows: 24, Cols: 80}}}); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []api.TermSize{{Rows: 0, Cols: 80}, {Rows: 24, Cols: api.MaxTermSide + 1}} {
		if err := x.Resize(bad); !errors.Is(err, ErrBadInput) {
			t.Fatalf("resize to %+v: %v", bad, err)
		}
	}
	if err := x.Resize(api.TermSize{Rows: 40, Cols: 120}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := x.Run(); err != nil {
		t.Fatal(err)
	}
	waitFinished(t, x)
	p, _ := x.Pull(0)
	var out strings.Builder
	for _, l := range p.JobLogs {
		out.Write(l.Message)
	}
	if got := strings.ReplaceAll(out.String(), "\r", ""); got != "40 120\n" {
		t.Fatalf("the job's terminal: %q, want 40 120", got)
	}
}

// TestSubmitTTYBounds: a submit's terminal size out of bounds is bad
// input (the server's 400), checked before anything is kept.
func TestSubmitTTYBounds(t *testing.T) {
	x := newTestExecutor(t)
	t.Cleanup(func() { x.Close() })
	for _, s := range []api.TermSize{{}, {Rows: -1, Cols: 80}, {Rows: 24, Cols: 1 << 16}} {
		err := x.Submit(api.SubmitBody{JobSpec: api.JobSpec{Commands: []string{"true"}}, Tandem: &api.SubmitExtras{TTY: &s}})
		if !errors.Is(err, ErrBadInput) || !errors.Is(err, api.ErrBadTermSize) {
			t.Fatalf("submit of tty %+v: %v", s, err)
		}
	}
	if x.State() != WaitSubmit {
		t.Fatalf("a refused submit moved the runner to %s", x.State())
	}
}
