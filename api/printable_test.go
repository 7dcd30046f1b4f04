package api

import "testing"

func TestPrintable(t *testing.T) {
	for in, want := range map[string]string{
		"ubuntu:22.04":     "ubuntu:22.04",
		"héllo ✓":          "héllo ✓",
		"\x1b]0;pwned\x07": `\x1b]0;pwned\x07`,
		"a\x1b[2Jb":        `a\x1b[2Jb`,
		"tab\there\nline":  `tab\x09here\x0aline`,
		"c1 \u009b31m":     `c1 \u009b31m`,
		"bad \xff utf8":    `bad \xff utf8`,
		"del\x7f":          `del\x7f`,
	} {
		if got := Printable(in); got != want {
			t.Errorf("Printable(%q) = %q, want %q", in, got, want)
		}
	}
}

func FuzzPrintable(f *testing.F) {
	f.Add("\x1b]0;x\x07\u009b\xff")
	f.Fuzz(func(t *testing.T, s string) {
		out := Printable(s)
		for _, r := range out {
			if r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) {
				t.Fatalf("control character %U left in %q", r, out)
			}
		}
		if Printable(out) != out {
			t.Fatalf("not idempotent: %q", out)
		}
	})
}
