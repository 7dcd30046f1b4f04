package ctl

import (
	"bytes"
	"testing"
)

func TestLineEnds(t *testing.T) {
	for _, tc := range []struct {
		writes []string
		want   string
	}{
		{[]string{"hello\r\n"}, "hello\n"},
		{[]string{"hello\r", "\nworld\r\n"}, "hello\nworld\n"},
		{[]string{"10%\r20%\r", "30%\r\ndone\r\n"}, "10%\r20%\r30%\ndone\n"},
		{[]string{"a\r", "b"}, "a\rb"},
		{[]string{"no line end"}, "no line end"},
	} {
		var b bytes.Buffer
		w := LineEnds(&b)
		for _, s := range tc.writes {
			if n, err := w.Write([]byte(s)); err != nil || n != len(s) {
				t.Fatal(n, err)
			}
		}
		if b.String() != tc.want {
			t.Errorf("%q: got %q, want %q", tc.writes, b.String(), tc.want)
		}
	}
}

// TestTailWriter: the last n lines, whatever the writes' boundaries; an
// unended last line counts as one.
func TestTailWriter(t *testing.T) {
	for _, chunks := range [][]string{{"a\nb\nc\nd"}, {"a\n", "b", "\nc\n", "d"}, {"a\nb\nc\n", "d"}} {
		tw := &tailWriter{n: 2}
		for _, c := range chunks {
			_, _ = tw.Write([]byte(c))
		}
		if got := string(tw.bytes()); got != "c\nd" {
			t.Errorf("%q: %q", chunks, got)
		}
	}
	tw := &tailWriter{n: 2}
	_, _ = tw.Write([]byte("a\nb\nc\n"))
	if got := string(tw.bytes()); got != "b\nc\n" {
		t.Errorf("ended lines: %q", got)
	}
	// --tail 0: no line at all, an unended one neither (docker logs --tail 0).
	tw = &tailWriter{n: 0}
	_, _ = tw.Write([]byte("a\nb\nc"))
	if got := tw.bytes(); len(got) != 0 {
		t.Errorf("tail 0: %q", got)
	}
}
