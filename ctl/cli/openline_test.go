package cli

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/urfave/cli/v2"
)

// tandem's own lines start on a line of their own after job output that
// left one open (printf abc; a progress bar's \r), and add nothing after
// output that ended its line.
func TestOwnLinesAfterAnOpenLine(t *testing.T) {
	for _, tc := range []struct{ job, want string }{
		{"abc", "abc\njob done\n"},
		{"abc\n", "abc\njob done\n"},
		{"50%\r", "50%\r\njob done\n"},
		{"", "job done\n"},
		{"a\nb", "a\nb\njob done\n"},
	} {
		var b bytes.Buffer
		c := cli.NewContext(&cli.App{Writer: &b, ErrWriter: &b}, nil, nil)
		out := shareLines(c, &b, true)
		if _, err := out.Write([]byte(tc.job)); err != nil {
			t.Fatal(err)
		}
		if _, err := c.App.ErrWriter.Write([]byte("job done\n")); err != nil {
			t.Fatal(err)
		}
		if b.String() != tc.want {
			t.Errorf("job %q: got %q, want %q", tc.job, b.String(), tc.want)
		}
	}
}

// Only one stream for both (2>&1, a terminal) counts as shared; output to
// a file with tandem's lines elsewhere is left as it is.
func TestSameStream(t *testing.T) {
	dir := t.TempDir()
	f1, err := os.Create(filepath.Join(dir, "out"))
	if err != nil {
		t.Fatal(err)
	}
	defer f1.Close()
	f1again, err := os.OpenFile(f1.Name(), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f1again.Close()
	f2, err := os.Create(filepath.Join(dir, "err"))
	if err != nil {
		t.Fatal(err)
	}
	defer f2.Close()
	if !sameStream(cli.NewContext(&cli.App{Writer: f1, ErrWriter: f1again}, nil, nil)) {
		t.Error("one file opened twice is one stream")
	}
	if sameStream(cli.NewContext(&cli.App{Writer: f1, ErrWriter: f2}, nil, nil)) {
		t.Error("two files are one stream")
	}
	var b bytes.Buffer
	if sameStream(cli.NewContext(&cli.App{Writer: &b, ErrWriter: f2}, nil, nil)) {
		t.Error("a buffer and a file are one stream")
	}
	c := cli.NewContext(&cli.App{Writer: f1, ErrWriter: f2}, nil, nil)
	if out := shareLines(c, f1, false); out != f1 || c.App.ErrWriter != f2 {
		t.Error("unshared streams were wrapped")
	}
}
