package cli

import (
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/creack/pty"
	"golang.org/x/sys/unix"

	"github.com/tandem-run/tandem/api"
)

// TestRunTerminalSize: -t's size is the terminal's (stdout's, else
// stdin's), within the bounds; 24x80 where there is no terminal or it
// has no size.
func TestRunTerminalSize(t *testing.T) {
	master, tty := openPTY(t)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	for _, tc := range []struct {
		name      string
		set       pty.Winsize
		in        any
		out       any
		want      api.TermSize
		following bool
	}{
		{"stdout a terminal", pty.Winsize{Rows: 33, Cols: 111}, r, tty, api.TermSize{Rows: 33, Cols: 111}, true},
		{"stdin a terminal", pty.Winsize{Rows: 44, Cols: 99}, tty, w, api.TermSize{Rows: 44, Cols: 99}, true},
		{"never sized", pty.Winsize{}, tty, tty, defaultTermSize(), true},
		{"past the bound", pty.Winsize{Rows: 20000, Cols: 65535}, tty, tty, api.TermSize{Rows: api.MaxTermSide, Cols: api.MaxTermSide}, true},
		{"no terminal", pty.Winsize{Rows: 50, Cols: 50}, r, w, defaultTermSize(), false},
		{"not files", pty.Winsize{Rows: 50, Cols: 50}, nil, nil, defaultTermSize(), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := pty.Setsize(master, &tc.set); err != nil {
				t.Fatal(err)
			}
			rt := newRunTerminal(asReader(tc.in), asWriter(tc.out), false)
			if got := rt.size(); got != tc.want {
				t.Fatalf("size %+v, want %+v", got, tc.want)
			}
			sizes, stop := rt.follow()
			stop()
			if (sizes != nil) != tc.following {
				t.Fatalf("follows the window: %v, want %v", sizes != nil, tc.following)
			}
		})
	}
}

func asReader(v any) *os.File {
	f, _ := v.(*os.File)
	return f
}

func asWriter(v any) *os.File { return asReader(v) }

// TestRunTerminalFollows: after the window changes (the size set, then
// SIGWINCH) the newest size is sent; one not taken yet is replaced.
func TestRunTerminalFollows(t *testing.T) {
	master, tty := openPTY(t)
	rt := newRunTerminal(tty, tty, false)
	sizes, stop := rt.follow()
	defer stop()
	for _, s := range []pty.Winsize{{Rows: 10, Cols: 20}, {Rows: 60, Cols: 200}} {
		if err := pty.Setsize(master, &s); err != nil {
			t.Fatal(err)
		}
		if err := syscall.Kill(os.Getpid(), syscall.SIGWINCH); err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond) // both signals handled before the read: only the newest is kept
	}
	select {
	case got := <-sizes:
		if got != (api.TermSize{Rows: 60, Cols: 200}) {
			t.Fatalf("size %+v, want 60x200", got)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no size after SIGWINCH")
	}
	select {
	case got := <-sizes:
		t.Fatalf("a stale size was kept: %+v", got)
	default:
	}
}

// TestRunTerminalRaw: -it makes stdin's terminal raw (no echo, no
// signals from keys, no line editing) and restore gives back the state
// it had, byte for byte; twice is harmless, and -t alone leaves it.
func TestRunTerminalRaw(t *testing.T) {
	_, tty := openPTY(t)
	state := func() unix.Termios {
		tio, err := unix.IoctlGetTermios(int(tty.Fd()), unix.TCGETS)
		if err != nil {
			t.Fatal(err)
		}
		return *tio
	}
	before := state()
	alone := newRunTerminal(tty, tty, false)
	alone.makeRaw()
	if state() != before {
		t.Fatal("-t alone changed the terminal")
	}
	rt := newRunTerminal(tty, tty, true)
	rt.makeRaw()
	rt.makeRaw()
	raw := state()
	if raw.Lflag&(unix.ECHO|unix.ISIG|unix.ICANON) != 0 {
		t.Fatalf("not raw: lflag %#x", raw.Lflag)
	}
	rt.restore()
	rt.restore()
	if state() != before {
		t.Fatalf("restored %+v, want %+v", state(), before)
	}
	var none *runTerminal
	none.restore()
}
