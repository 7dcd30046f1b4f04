package executor

import (
	"bytes"
	"errors"
	"io"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
)

func submitStream(t *testing.T, x *Executor, commands ...string) {
	t.Helper()
	wd := t.TempDir()
	if err := x.Submit(api.SubmitBody{JobSpec: api.JobSpec{Commands: commands, WorkingDir: &wd, RepoDir: &wd},
		Tandem: &api.SubmitExtras{Stdin: api.StdinStream}}); err != nil {
		t.Fatal(err)
	}
}

func lastState(t *testing.T, x *Executor) api.JobStateEvent {
	t.Helper()
	ev, ok := x.FinalState()
	if !ok {
		t.Fatal("no final state")
	}
	return ev
}

// TestStdinStream: a job submitted with a streamed stdin reads, in order,
// everything its one feeder writes (fed before the job started, too), then
// end of file when the feeder closes.
func TestStdinStream(t *testing.T) {
	x := newTestExecutor(t)
	t.Cleanup(func() { x.Close() })
	if _, _, err := x.TakeStdin(); !errors.Is(err, ErrState) {
		t.Fatalf("stdin before a submit: %v", err)
	}
	const big = 3<<20 + 17
	submitStream(t, x, "sh", "-c", `read -r a; [ "$a" = hello ] || exit 9; n=$(wc -c); [ "$n" -eq `+strconv.Itoa(big)+` ] || exit 8`)
	_, release, err := x.TakeStdin()
	if err != nil {
		t.Fatal(err)
	}
	release() // one that fed nothing gives it back
	w, _, err := x.TakeStdin()
	if err != nil {
		t.Fatalf("the stdin given back: %v", err)
	}
	if _, _, err := x.TakeStdin(); !errors.Is(err, ErrState) {
		t.Fatalf("a second feeder: %v", err)
	}
	fed := make(chan error, 1)
	go func() {
		_, err := io.Copy(w, io.MultiReader(strings.NewReader("hello\n"), bytes.NewReader(make([]byte, big))))
		fed <- errors.Join(err, w.Close())
	}()
	time.Sleep(50 * time.Millisecond) // the feeder waits for the job
	if _, _, err := x.Run(); err != nil {
		t.Fatal(err)
	}
	waitFinished(t, x)
	if err := <-fed; err != nil {
		t.Fatalf("feeding: %v", err)
	}
	if ev := lastState(t, x); ev.ExitStatus == nil || *ev.ExitStatus != 0 {
		t.Fatalf("the job did not read all of its input, then its end: %+v", ev)
	}
	if _, _, err := x.TakeStdin(); !errors.Is(err, ErrState) {
		t.Fatalf("stdin after the job: %v", err)
	}
}

// TestStdinFeederNeverHangs: a feeder whose job does not read is told so
// (ErrStdinOver) when the job ends, and when it is stopped before it ran.
func TestStdinFeederNeverHangs(t *testing.T) {
	feed := func(x *Executor) chan error {
		w, _, err := x.TakeStdin()
		if err != nil {
			t.Fatal(err)
		}
		fed := make(chan error, 1)
		go func() {
			_, err := w.Write(make([]byte, 8<<20))
			fed <- err
		}()
		return fed
	}
	wait := func(what string, fed chan error) {
		t.Helper()
		select {
		case err := <-fed:
			if !errors.Is(err, ErrStdinOver) {
				t.Fatalf("%s: the feeder got %v, want ErrStdinOver", what, err)
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("%s: the feeder still waits", what)
		}
	}
	x := newTestExecutor(t)
	t.Cleanup(func() { x.Close() })
	submitStream(t, x, "true")
	fed := feed(x)
	if _, _, err := x.Run(); err != nil {
		t.Fatal(err)
	}
	waitFinished(t, x)
	wait("the job ended", fed)

	y := newTestExecutor(t)
	submitStream(t, y, "cat")
	fed = feed(y)
	y.Stop()
	wait("stopped before run", fed)

	z := newTestExecutor(t)
	submitStream(t, z, "cat")
	fed = feed(z)
	submitStream(t, z, "cat") // replaced: the first submit's job never runs
	wait("replaced submit", fed)
	if _, _, err := z.TakeStdin(); err != nil {
		t.Fatalf("the new submit's stdin: %v", err)
	}
	z.Stop()
}
