package ctl

import (
	"archive/tar"
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/tandem-run/tandem/api"
)

// codeDir makes a directory with a file, a subdirectory, a link, a named
// pipe and a listening Unix socket (a git fsmonitor's, an editor's).
func codeDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(dir, "sub", ".git"), 0o755))
	must(os.WriteFile(filepath.Join(dir, "sub", "main.py"), []byte("print('hi')\n"), 0o644))
	must(os.Symlink("sub/main.py", filepath.Join(dir, "link")))
	must(syscall.Mkfifo(filepath.Join(dir, "pipe"), 0o644))
	ln, err := net.Listen("unix", filepath.Join(dir, "sub", ".git", "fsmonitor--daemon.ipc"))
	must(err)
	t.Cleanup(func() { ln.Close() })
	return dir
}

// tarNames lists an archive's entries (name: content for files).
func tarNames(t *testing.T, b []byte) []string {
	t.Helper()
	var out []string
	tr := tar.NewReader(bytes.NewReader(b))
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		name := hdr.Name
		switch hdr.Typeflag {
		case tar.TypeReg:
			body, _ := io.ReadAll(tr)
			name += ": " + string(body)
		case tar.TypeSymlink:
			name += " -> " + hdr.Linkname
		}
		out = append(out, name)
	}
}

// Sockets and named pipes are left out of the code and said so; a socket
// in .git made `tandem run --code` fail with "archive/tar: sockets not
// supported" after its task was made.
func TestCodeLeavesOutWhatIsNotCode(t *testing.T) {
	dir := codeDir(t)
	var b bytes.Buffer
	if err := tarDir(dir, &b); err != nil {
		t.Fatal(err)
	}
	want := []string{"link -> sub/main.py", "sub/", "sub/.git/", "sub/main.py: print('hi')\n"}
	if got := tarNames(t, b.Bytes()); !slices.Equal(got, want) {
		t.Fatalf("archive holds %q, want %q", got, want)
	}
	var said []string
	o := RunOptions{CodeDir: dir}
	if err := checkCode(o, func(e Event) { said = append(said, e.Text) }); err != nil {
		t.Fatal(err)
	}
	if len(said) != 1 || !strings.HasSuffix(said[0], "(sockets, devices, named pipes): pipe, sub/.git/fsmonitor--daemon.ipc") {
		t.Fatalf("said %q", said)
	}
	s, err := scanCode(dir)
	if err != nil || s.size < int64(b.Len())-2*tarBlock || s.size > int64(b.Len()) {
		t.Fatalf("scanned size %d for a %d-byte archive (%v)", s.size, b.Len(), err)
	}
}

// A code directory the runner would refuse is refused before anything is
// made, naming its largest files; so is one that is not a directory.
func TestCodeTooLargeIsRefusedFirst(t *testing.T) {
	dir := t.TempDir()
	big := filepath.Join(dir, "data", "weights.bin")
	if err := os.MkdirAll(filepath.Dir(big), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "train.py"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(big)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(api.MaxUpload); err != nil { // sparse: no disk used
		t.Fatal(err)
	}
	f.Close()
	err = checkCode(RunOptions{CodeDir: dir}, nil)
	if err == nil || !strings.Contains(err.Error(), "256MiB as an archive; a runner takes at most 256MiB unless") ||
		!strings.Contains(err.Error(), "largest files: data/weights.bin (256MiB), train.py (1B)") {
		t.Fatalf("%v", err)
	}
	// A runner whose limit was raised, and no check at all.
	if err := checkCode(RunOptions{CodeDir: dir, CodeLimit: 1 << 30}, nil); err != nil {
		t.Fatalf("under a raised limit: %v", err)
	}
	if err := checkCode(RunOptions{CodeDir: dir, CodeLimit: -1}, nil); err != nil {
		t.Fatalf("with no check: %v", err)
	}
	if err := checkCode(RunOptions{CodeDir: dir, CodeLimit: 1 << 20}, nil); err == nil || !strings.Contains(err.Error(), "at most 1MiB") {
		t.Fatalf("under a lowered limit: %v", err)
	}
	if err := os.Truncate(big, api.MaxUpload-64<<10); err != nil {
		t.Fatal(err)
	}
	if err := checkCode(RunOptions{CodeDir: dir}, nil); err != nil {
		t.Fatalf("a directory under the limit: %v", err)
	}
	if err := checkCode(RunOptions{CodeDir: filepath.Join(dir, "train.py")}, nil); err == nil || !strings.Contains(err.Error(), "not a directory") {
		t.Fatalf("a file as the code dir: %v", err)
	}
	if _, err := NewRun(testClient(t, Config{Shim: "127.0.0.1:1"}), RunOptions{CodeDir: filepath.Join(dir, "none"), Commands: []string{"true"}}); err == nil {
		t.Fatal("NewRun took a code dir that is not there")
	}
}

// growWriter appends to path once the archive has the file's header, as a
// job's log grows while the code is sent.
type growWriter struct {
	bytes.Buffer
	path  string
	grown bool
}

func (w *growWriter) Write(p []byte) (int, error) {
	n, err := w.Buffer.Write(p)
	if !w.grown && strings.Contains(w.String(), "grow.log") {
		w.grown = true
		f, ferr := os.OpenFile(w.path, os.O_APPEND|os.O_WRONLY, 0)
		if ferr != nil {
			return n, ferr
		}
		_, _ = f.WriteString(" and more written meanwhile")
		f.Close()
	}
	return n, err
}

// A file that grows while it is sent is sent as it was listed (tar's
// header carries its size); it failed the upload with "write too long".
func TestCodeFileGrowingWhileSent(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "grow.log")
	if err := os.WriteFile(p, []byte("first lines"), 0o644); err != nil {
		t.Fatal(err)
	}
	w := &growWriter{path: p}
	if err := tarDir(dir, w); err != nil {
		t.Fatal(err)
	}
	if !w.grown {
		t.Fatal("the file did not grow during the test")
	}
	if got := tarNames(t, w.Bytes()); !slices.Equal(got, []string{"grow.log: first lines"}) {
		t.Fatalf("archive holds %q", got)
	}
}

// A working dir the runner would refuse is refused before a task is made.
func TestWorkDirCheckedFirst(t *testing.T) {
	for wd, ok := range map[string]bool{"": true, "/workflow": true, "~": true, "~/src": true, "rel/dir": false, "~user/x": false, ".": false} {
		_, err := NewRun(testClient(t, Config{Shim: "127.0.0.1:1"}), RunOptions{WorkDir: wd, Commands: []string{"true"}})
		if (err == nil) != ok {
			t.Errorf("--workdir %q: %v", wd, err)
		}
		if err != nil && !strings.Contains(err.Error(), "must be absolute") {
			t.Errorf("--workdir %q: %v", wd, err)
		}
	}
}
