package e2e

import (
	"bytes"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/creack/pty"
	"golang.org/x/sys/unix"
)

// onPTY is tandem run under a real terminal, as a person's: the test is
// the terminal's other side (it types at ptmx, reads the screen there and
// resizes it).
type onPTY struct {
	t    *testing.T
	ptmx *os.File
	tty  *os.File // kept open: its state is read after tandem exits
	cmd  *exec.Cmd

	mu     sync.Mutex // guards screen
	screen bytes.Buffer
}

// startOnPTY starts tandem with args on a new terminal of size rows x cols,
// its stdin, stdout and stderr, and its controlling terminal.
func startOnPTY(t *testing.T, dir string, rows, cols uint16, args ...string) *onPTY {
	t.Helper()
	ptmx, tty, err := pty.Open()
	if err != nil {
		t.Fatal(err)
	}
	if err := pty.Setsize(ptmx, &pty.Winsize{Rows: rows, Cols: cols}); err != nil {
		t.Fatal(err)
	}
	cmd, _, _ := tandemIn(t, dir, nil, args...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = tty, tty, tty
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true}
	p := &onPTY{t: t, ptmx: ptmx, tty: tty, cmd: cmd}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			_ = cmd.Wait()
		}
		ptmx.Close()
		tty.Close()
		<-done
	})
	go func() {
		defer close(done)
		buf := make([]byte, 4096)
		for {
			n, err := ptmx.Read(buf)
			p.mu.Lock()
			p.screen.Write(buf[:n])
			p.mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	return p
}

// output is what the terminal showed, less its carriage returns (the job's
// terminal ends lines with "\r\n", which this one, not raw under -t alone,
// shows as "\r\r\n", as under docker run -t).
func (p *onPTY) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return strings.ReplaceAll(p.screen.String(), "\r", "")
}

// waitFor waits until the screen shows want.
func (p *onPTY) waitFor(want string) {
	p.t.Helper()
	for deadline := time.Now().Add(2 * time.Minute); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if strings.Contains(p.output(), want) {
			return
		}
		if p.cmd.ProcessState != nil {
			break
		}
	}
	p.t.Fatalf("the terminal never showed %q:\n%s", want, p.output())
}

// typeKeys types b at the terminal.
func (p *onPTY) typeKeys(b []byte) {
	p.t.Helper()
	if _, err := p.ptmx.Write(b); err != nil {
		p.t.Fatal(err)
	}
}

// resize resizes the terminal's window, as a person's drag: the kernel
// tells the foreground group (SIGWINCH), sent again to tandem itself
// should its group not be the foreground one.
func (p *onPTY) resize(rows, cols uint16) {
	p.t.Helper()
	if err := pty.Setsize(p.ptmx, &pty.Winsize{Rows: rows, Cols: cols}); err != nil {
		p.t.Fatal(err)
	}
	_ = p.cmd.Process.Signal(syscall.SIGWINCH)
}

// wait waits for tandem's exit and returns its code.
func (p *onPTY) wait() int {
	p.t.Helper()
	exited := make(chan error, 1)
	go func() { exited <- p.cmd.Wait() }()
	select {
	case err := <-exited:
		return exitCodeOf(err)
	case <-time.After(2 * time.Minute):
		p.t.Fatalf("tandem did not exit:\n%s", p.output())
	}
	return -1
}

// lflag is the terminal's local modes now.
func (p *onPTY) lflag() uint32 {
	p.t.Helper()
	tio, err := unix.IoctlGetTermios(int(p.tty.Fd()), unix.TCGETS)
	if err != nil {
		p.t.Fatal(err)
	}
	return tio.Lflag
}

// sttyG is stty -g of the terminal: every setting, as the shell saves it.
func (p *onPTY) sttyG() string {
	p.t.Helper()
	cmd := exec.Command("stty", "-g")
	cmd.Stdin = p.tty
	out, err := cmd.Output()
	if err != nil {
		p.t.Fatalf("stty -g: %v", err)
	}
	return strings.TrimSpace(string(out))
}

// TestTandemRunTTY (issue 67, -t/-it): under a real terminal, tandem run
// -it gives the job a terminal of this one's size, resizes it when the
// window changes (the job's SIGWINCH), makes this terminal raw while the
// job runs so a typed line and Ctrl-C reach the job as keys (its INT trap
// runs, tandem takes no interrupt: the exit is the job's), and leaves the
// terminal as it found it. -t alone sizes and resizes the job's terminal,
// leaves this one as it is, and the job's stdin ends at once.
func TestTandemRunTTY(t *testing.T) {
	h, shim, _ := realStack(t)
	dir := t.TempDir()

	t.Run("-it", func(t *testing.T) {
		job := `stty size; echo ready; read -r l; echo "line:$l"; trap 'echo winch $(stty size)' WINCH; trap 'echo got-int; exit 7' INT;` +
			` echo armed; i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; echo no-int`
		p := startOnPTY(t, dir, 37, 101, "run", "--rm", "-q", "--no-ssh-config", "--shim", shim, "-it", h.image, "sh", "-c", job)
		before := p.sttyG()
		p.waitFor("ready")
		if !strings.Contains(p.output(), "37 101\n") {
			t.Fatalf("the job's terminal at its start, want 37 101:\n%s", p.output())
		}
		if lf := p.lflag(); lf&(unix.ICANON|unix.ISIG|unix.ECHO) != 0 {
			t.Fatalf("this terminal is not raw while the job runs: lflag %#x", lf)
		}
		p.typeKeys([]byte("typed\r"))
		p.waitFor("armed")
		if !strings.Contains(p.output(), "line:typed\n") {
			t.Fatalf("the typed line:\n%s", p.output())
		}
		p.resize(50, 132)
		p.waitFor("winch 50 132")
		p.typeKeys([]byte{0x03})
		if code := p.wait(); code != 7 {
			t.Fatalf("tandem's exit %d, want the job's 7 (its INT trap):\n%s", code, p.output())
		}
		if out := p.output(); !strings.Contains(out, "got-int") || strings.Contains(out, "no-int") {
			t.Fatalf("Ctrl-C did not reach the job as its SIGINT:\n%s", out)
		}
		if after := p.sttyG(); after != before {
			t.Fatalf("the terminal after tandem: stty -g %q, before %q", after, before)
		}
	})

	t.Run("-t", func(t *testing.T) {
		// fd 0 is no terminal (the stdin ends at once): the size is read
		// from the job's terminal, /dev/tty.
		job := `stty size </dev/tty; read -r l || echo stdin-ended; i=0; while [ "$(stty size </dev/tty)" = "30 90" ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; echo now $(stty size </dev/tty)`
		p := startOnPTY(t, dir, 30, 90, "run", "--rm", "-q", "--no-ssh-config", "--shim", shim, "-t", h.image, "sh", "-c", job)
		before := p.sttyG()
		p.waitFor("stdin-ended")
		if !strings.Contains(p.output(), "30 90\n") {
			t.Fatalf("the job's terminal at its start, want 30 90:\n%s", p.output())
		}
		if lf := p.lflag(); lf&(unix.ICANON|unix.ISIG) != unix.ICANON|unix.ISIG {
			t.Fatalf("-t alone made this terminal raw: lflag %#x", lf)
		}
		p.resize(45, 160)
		p.waitFor("now 45 160")
		if code := p.wait(); code != 0 {
			t.Fatalf("tandem's exit %d:\n%s", code, p.output())
		}
		if after := p.sttyG(); after != before {
			t.Fatalf("the terminal after tandem: stty -g %q, before %q", after, before)
		}
	})
}

// TestTandemTTYWithoutTerminal: -it with stdin not a terminal is refused
// as docker refuses it, its words and exit 1, before anything is made;
// -t with nothing a terminal runs, on a 24x80 terminal as docker's.
func TestTandemTTYWithoutTerminal(t *testing.T) {
	h, shim, _ := realStack(t)
	dir := t.TempDir()
	for _, flags := range [][]string{{"-it"}, {"-i", "-t"}, {"--interactive", "--tty"}} {
		before, _ := h.client.ListTasks(t.Context())
		cmd, out, errb := tandemIn(t, dir, nil, append(append([]string{"run", "--shim", shim}, flags...), h.image, "true")...)
		cmd.Stdin = strings.NewReader("not a terminal\n")
		if _, errOut, code := outcome(cmd, out, errb); code != 1 || errOut != "the input device is not a TTY\n" {
			t.Errorf("%v with a pipe for stdin: %d %q, want 1 and docker's line", flags, code, errOut)
		}
		if after, _ := h.client.ListTasks(t.Context()); len(after) != len(before) {
			t.Errorf("%v with a pipe for stdin made a task", flags)
		}
	}
	cmd, out, errb := tandemIn(t, dir, nil, "run", "--rm", "-q", "--no-ssh-config", "--shim", shim, "-t", h.image, "sh", "-c", "stty size </dev/tty")
	if stdout, errOut, code := outcome(cmd, out, errb); code != 0 || stdout != "24 80\n" {
		t.Errorf("-t piped: %d %q %q, want 24 80", code, stdout, errOut)
	}
}
