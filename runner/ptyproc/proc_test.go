package ptyproc

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tandem-run/tandem/runner/ptyio"
)

// lockedBuffer is a bytes.Buffer safe for exec's copier and the test.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// readAll reads a terminal's output until the hang-up (EIO).
func readAll(t *testing.T, p *Proc) string {
	t.Helper()
	r := ptyio.NewReader(p.Terminal())
	r.Plain()
	b, _ := io.ReadAll(r)
	return string(b)
}

func TestStartTTY(t *testing.T) {
	p, err := Start(Spec{Path: "sh", Args: []string{"sh", "-c", `tty >/dev/null && echo "tty:$TANDEM_X" && stty size && exit 3`},
		Env: []string{"TANDEM_X=yes", "PATH=/usr/bin:/bin"}, Dir: "/", TTY: true, Size: &Size{Rows: 33, Cols: 101}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	out := readAll(t, p)
	if code, sig := p.Wait(); code != 3 || sig != 0 {
		t.Fatalf("exit %d, %v; want 3", code, sig)
	}
	if !strings.Contains(out, "tty:yes") || !strings.Contains(out, "33 101") {
		t.Fatalf("output %q: want a terminal of 33x101 and the environment", out)
	}
	p.Close() // idempotent
}

// The job's output reader makes raw reads of the master, which must never
// sleep in the kernel: the master is non-blocking from Start on and stays
// so through everything the runner does with it (a resize, Ctrl-C, the
// count of unread output, the foreground group), none of which may take
// the descriptor with os.File.Fd (that makes it blocking again).
// TestTTYWithStdin: a Stdin replaces only fd 0. The job reads it to its
// end (then end of file, not a wait for typing), while its output still
// goes to the terminal, which stays its controlling terminal (/dev/tty).
func TestTTYWithStdin(t *testing.T) {
	script := `read -r line; echo "got:$line"; cat; echo "eof"; ` +
		`[ -t 0 ] || echo "stdin:pipe"; [ -t 1 ] && echo "stdout:tty"; ` +
		`echo hi >/dev/tty && echo "devtty:ok"`
	for _, tc := range []struct {
		name, in string
		want     []string
	}{
		{"some input", "first\nrest\n", []string{"got:first", "rest", "eof"}},
		{"none", "", []string{"got:", "eof"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := Start(Spec{Path: "sh", Args: []string{"sh", "-c", script}, Env: []string{"PATH=/usr/bin:/bin"},
				Dir: "/", TTY: true, Stdin: strings.NewReader(tc.in)})
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			done := make(chan string, 1)
			go func() { done <- readAll(t, p) }()
			var out string
			select {
			case out = <-done:
			case <-time.After(20 * time.Second):
				_ = p.Signal(syscall.SIGKILL)
				t.Fatalf("the job still waits for input: %q", <-done)
			}
			if code, sig := p.Wait(); code != 0 || sig != 0 {
				t.Fatalf("exit %d, %v; output %q", code, sig, out)
			}
			for _, w := range append(tc.want, "stdin:pipe", "stdout:tty", "devtty:ok") {
				if !strings.Contains(out, w) {
					t.Errorf("output %q lacks %q", out, w)
				}
			}
		})
	}
}

func TestTerminalStaysNonBlocking(t *testing.T) {
	p, err := Start(Spec{Path: "sh", Args: []string{"sh", "-c", "read x"},
		Env: []string{"PATH=/usr/bin:/bin"}, Dir: "/", TTY: true, Size: &Size{Rows: 24, Cols: 80}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	nonblocking := func(when string) {
		t.Helper()
		rc, err := p.Terminal().SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		var flags int
		var ferr error
		if err := rc.Control(func(fd uintptr) { flags, ferr = unix.FcntlInt(fd, unix.F_GETFL, 0) }); err != nil || ferr != nil {
			t.Fatal(err, ferr)
		}
		if flags&unix.O_NONBLOCK == 0 {
			t.Fatalf("the master is blocking %s", when)
		}
	}
	nonblocking("after Start")
	if err := p.Resize(Size{Rows: 40, Cols: 120}); err != nil {
		t.Fatal(err)
	}
	nonblocking("after Resize")
	if _, err := p.Unread(); err != nil {
		t.Fatal(err)
	}
	nonblocking("after Unread")
	if _, err := p.ForegroundGroup(); err != nil {
		t.Fatal(err)
	}
	nonblocking("after ForegroundGroup")
	if err := p.Interrupt(); err != nil {
		t.Fatal(err)
	}
	nonblocking("after Interrupt")
	p.Wait() // Ctrl-C ends the read
}

func TestStartErrorsAreShellCodes(t *testing.T) {
	_, err := Start(Spec{Path: "/nonexistent/prog", TTY: true})
	var se *StartError
	if !errors.As(err, &se) || se.Code != 127 {
		t.Fatalf("a missing program: %v, want StartError 127", err)
	}
	notExec := filepath.Join(t.TempDir(), "script")
	if err := os.WriteFile(notExec, []byte("#!/bin/sh\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err = Start(Spec{Path: notExec})
	if !errors.As(err, &se) || se.Code != 126 {
		t.Fatalf("a program that cannot run: %v, want StartError 126", err)
	}
}

func TestPipesDoNotWaitForStdin(t *testing.T) {
	// A client that never closes its stdin must not keep the session
	// open after the process exited.
	stdinR, stdinW := io.Pipe()
	defer stdinW.Close()
	var out lockedBuffer
	p, err := Start(Spec{Path: "/bin/sh", Args: []string{"sh", "-c", "read line; echo got:$line; exit 4"},
		Stdin: stdinR, Stdout: &out, Stderr: &out})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stdinW.Write([]byte("hello\n")); err != nil {
		t.Fatal(err)
	}
	if code, _ := p.Wait(); code != 4 {
		t.Fatalf("exit %d, want 4", code)
	}
	if got := out.String(); got != "got:hello\n" {
		t.Fatalf("output %q", got)
	}
	if p.Terminal() != nil || p.Resize(Size{1, 1}) == nil {
		t.Fatal("a process without TTY has no terminal")
	}
}

func TestSignalReachesTheGroup(t *testing.T) {
	// The child is in the shell's group: a signal to the group ends both,
	// and the status is 128+N as a shell reports it.
	var out lockedBuffer
	p, err := Start(Spec{Path: "/bin/sh", Args: []string{"sh", "-c", "sleep 60 & echo started; wait"}, Stdout: &out})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return strings.Contains(out.String(), "started") })
	if err := p.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code, sig := p.Wait(); code != 128+15 || sig != syscall.SIGTERM {
		t.Fatalf("exit %d, %v; want 143 by SIGTERM", code, sig)
	}
	waitFor(t, func() bool { return len(groupMembers(p.Pid())) == 0 })
}

func TestSignalSessionReachesBackgroundGroups(t *testing.T) {
	// An interactive shell puts a background job in its own group; a
	// signal to the session still reaches it.
	p, err := Start(Spec{Path: "/bin/sh", Args: []string{"sh", "-i", "-c", "sleep 60 & echo bg:$!; wait"},
		Env: []string{"PATH=/usr/bin:/bin", "PS1="}, TTY: true})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	waitFor(t, func() bool { return len(SessionMembers("/proc", p.Pid())) >= 2 })
	if n := p.SignalSession(syscall.SIGKILL); n < 2 {
		t.Fatalf("signalled %d processes, want the shell and its job", n)
	}
	if code, _ := p.Wait(); code != 128+9 {
		t.Fatalf("exit %d, want 137", code)
	}
	waitFor(t, func() bool { return len(SessionMembers("/proc", p.Pid())) == 0 })
}

func TestSessionMembersParsesComm(t *testing.T) {
	root := t.TempDir()
	write := func(pid, stat string) {
		if err := os.MkdirAll(filepath.Join(root, pid), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, pid, "stat"), []byte(stat), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("10", "10 (a) (b) S 1 10 10 0") // comm with ") (": the last ')' counts
	write("11", "11 (x) S 10 11 10 0")    // same session
	write("12", "12 (y) S 1 12 12 0")     // another session
	write("13", "13 (short")              // damaged
	write("self", "99 (z) S 1 99 10 0")   // not a pid
	got := SessionMembers(root, 10)
	if len(got) != 2 || got[0]+got[1] != 21 {
		t.Fatalf("members %v, want 10 and 11", got)
	}
}

// groupMembers lists live processes of a process group.
func groupMembers(pgid int) []int {
	var out []int
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		s := string(b)
		i := strings.LastIndexByte(s, ')')
		f := strings.Fields(s[i+1:])
		if len(f) > 2 && f[0] != "Z" && f[2] == strconv.Itoa(pgid) {
			out = append(out, pgid)
		}
	}
	return out
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached in 10 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
