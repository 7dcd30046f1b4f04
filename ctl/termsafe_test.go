package ctl

import (
	"bytes"
	"strings"
	"testing"
)

// safeThrough writes in to TerminalSafe in chunks of step bytes (0: one
// write) and returns what reached the terminal.
func safeThrough(in string, step int) string {
	var out bytes.Buffer
	w := TerminalSafe(&out)
	if step <= 0 {
		step = len(in) + 1
	}
	for i := 0; i < len(in); i += step {
		_, _ = w.Write([]byte(in[i:min(i+step, len(in))]))
	}
	return out.String()
}

// What a terminal would answer is dropped; everything else a job draws
// with passes byte for byte, whole or split anywhere.
func TestTerminalSafe(t *testing.T) {
	for _, tc := range []struct{ name, in, want string }{
		{"plain", "hello\r\nworld\n", "hello\r\nworld\n"},
		{"colours and cursor", "\x1b[31mred\x1b[0m \x1b[2K\r 42%|###   |\x1b[1A\x1b[?25l", "\x1b[31mred\x1b[0m \x1b[2K\r 42%|###   |\x1b[1A\x1b[?25l"},
		{"title set, link, charset", "\x1b]0;train\x07\x1b]8;;https://x.y/?a=1\x1b\\x\x1b]8;;\x1b\\\x1b(B\x1b7\x1b8", "\x1b]0;train\x07\x1b]8;;https://x.y/?a=1\x1b\\x\x1b]8;;\x1b\\\x1b(B\x1b7\x1b8"},
		{"title report after a title", "\x1b]2;rm -rf ~\x07\x1b[21t\n", "\x1b]2;rm -rf ~\x07\n"},
		{"status and cursor reports", "a\x1b[5nb\x1b[6nc\x1b[?6nd", "abcd"},
		{"device attributes", "\x1b[c\x1b[0c\x1b[>c\x1b[=c\x1bZ.", "."},
		{"window reports, not moves", "\x1b[14t\x1b[18;1t\x1b[8;24;80t\x1b[22;0t", "\x1b[8;24;80t\x1b[22;0t"},
		{"mode, version, keyboard queries", "\x1b[?2004$p\x1b[>q\x1b[?u\x1b[1x|\x1b[>1u", "|\x1b[>1u"},
		{"clipboard", "x\x1b]52;c;cm0gLXJmIH4K\x07y\x1b]52;c;?\x1b\\z", "xyz"},
		{"terminals' own reports and files", "a\x1b]1337;ReportCellSize\x07b\x1b]1337;RequestUpload=format=tgz\x1b\\c\x1b]5522;type=read\x07d\x1b]46;/tmp/x\x07e", "abcde"},
		{"colour queries", "\x1b]11;?\x07\x1b]4;1;?\x1b\\\x1b]10;#ffffff\x07", "\x1b]10;#ffffff\x07"},
		{"DCS, APC, PM, SOS", "a\x1bP$qm\x1b\\b\x1b_app\x1b\\c\x1b^pm\x1b\\d\x1bXsos\x1b\\e", "abcde"},
		{"ENQ anywhere", "a\x05b\x1b[3\x05m", "ab\x1b[3m"},
		{"CAN aborts", "\x1b[6\x18n\x1b]52;c;x\x1ay", "ny"},
		{"ESC restarts a sequence", "\x1b[12\x1b[6n\x1b]0;t\x1b[1m", "\x1b[1m"},
	} {
		for _, step := range []int{0, 1, 2, 3, 7} {
			if got := safeThrough(tc.in, step); got != tc.want {
				t.Errorf("%s (writes of %d): got %q, want %q", tc.name, step, got, tc.want)
			}
		}
	}
}

// A sequence that never ends is not held without bound: past
// maxHeldSequence it is dropped to its end, and what follows passes.
func TestTerminalSafeBoundsAHeldSequence(t *testing.T) {
	var out bytes.Buffer
	w := TerminalSafe(&out).(*termSafe)
	_, _ = w.Write([]byte("\x1b]0;"))
	chunk := []byte(strings.Repeat("x", 4096))
	for range 1000 {
		_, _ = w.Write(chunk)
	}
	if cap(w.held) > 2*maxHeldSequence {
		t.Fatalf("holds %d bytes of an endless OSC", cap(w.held))
	}
	_, _ = w.Write([]byte("\x07after"))
	if out.String() != "after" {
		t.Fatalf("after an endless OSC: %q", out.String())
	}
}

// FuzzTerminalSafe: whatever a job writes, split anywhere, the same bytes
// come out, no answer-making sequence survives, and memory stays bounded.
func FuzzTerminalSafe(f *testing.F) {
	f.Add("\x1b]2;x\x07\x1b[21t\x1b[6n\x05\x1bP$q\x1b\\ok", uint8(3))
	f.Add("\x1b[\x1b]52;c;?\x1b\x1b\\\x1b[?1$p\x1bZ", uint8(1))
	f.Fuzz(func(t *testing.T, in string, split uint8) {
		whole := safeThrough(in, 0)
		if parts := safeThrough(in, int(split%16)+1); parts != whole {
			t.Fatalf("split writes differ: %q vs %q", parts, whole)
		}
		// What came out is itself safe: filtering it again changes nothing.
		if again := safeThrough(whole, 0); again != whole {
			t.Fatalf("not stable: %q -> %q", whole, again)
		}
		if strings.ContainsRune(whole, 0x05) {
			t.Fatalf("ENQ passed: %q", whole)
		}
		for _, bad := range []string{"\x1b[6n", "\x1b[c", "\x1b[21t", "\x1b]52;", "\x1bP", "\x1bZ"} {
			if strings.Contains(whole, bad) {
				t.Fatalf("%q passed: %q", bad, whole)
			}
		}
		if len(whole) > len(in) {
			t.Fatalf("output %d bytes from %d", len(whole), len(in))
		}
	})
}
