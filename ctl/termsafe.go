package ctl

import (
	"bytes"
	"io"
	"strconv"
)

// TerminalSafe returns w for a job's output on the user's terminal: every
// byte passes as it is (colours, cursor moves, progress bars, titles)
// except the sequences that make a terminal answer. A terminal writes its
// answer to its input, and tandem reads none: after tandem exits the
// user's shell reads it as typed (a window title a job set, reported back,
// runs as a command). Dropped: ENQ (answerback); ESC Z and the CSI
// queries (device status and attributes, window and title reports, mode
// and version queries, DECREQTPARM); OSC 52 (the clipboard), the
// terminals' own OSCs that report, upload or write files (xterm's 46,
// iTerm2's 1337, kitty's 5113 and 5522) and OSC queries ("?"); DCS, SOS,
// PM and APC strings (DECRQSS, tmux passthrough). A sequence split across
// writes is held until it ends, at most maxHeldSequence bytes: a longer one
// is dropped to its end.
func TerminalSafe(w io.Writer) io.Writer { return &termSafe{w: w} }

// maxHeldSequence bounds one escape sequence held back (an OSC 8 link's
// URL is the longest a job writes in practice).
const maxHeldSequence = 8 << 10

type termState int

const (
	tsGround    termState = iota
	tsEsc                 // after ESC
	tsCSI                 // in ESC [ ... up to the final byte
	tsOSC                 // in ESC ] ... up to BEL or ESC \
	tsOSCEsc              // ESC inside an OSC: \ ends it
	tsString              // in DCS, SOS, PM or APC: dropped up to ESC \
	tsStringEsc           // ESC inside a dropped string
)

type termSafe struct {
	w     io.Writer
	state termState
	held  []byte // the sequence so far (ESC included); emptied when drop is set
	drop  bool   // the sequence is too long: dropped up to its end
	out   []byte // this Write's output (step appends to it)
}

func (t *termSafe) Write(p []byte) (int, error) {
	t.out = t.out[:0]
	for i := 0; i < len(p); {
		if t.state != tsGround {
			t.step(p[i])
			i++
			continue
		}
		// Plain text runs up to the next ESC or ENQ.
		j := bytes.IndexAny(p[i:], "\x1b\x05")
		if j < 0 {
			t.out = append(t.out, p[i:]...)
			break
		}
		t.out = append(t.out, p[i:i+j]...)
		if p[i+j] == 0x1b {
			t.begin(0x1b)
		}
		i += j + 1
	}
	if len(t.out) > 0 {
		if _, err := t.w.Write(t.out); err != nil {
			return 0, err
		}
	}
	if cap(t.out) > 64<<10 {
		t.out = nil
	}
	return len(p), nil
}

func (t *termSafe) begin(b byte) {
	t.state, t.held, t.drop = tsEsc, append(t.held[:0], b), false
}

func (t *termSafe) hold(b byte) {
	if t.drop {
		return
	}
	if len(t.held) >= maxHeldSequence {
		t.drop, t.held = true, t.held[:0]
		return
	}
	t.held = append(t.held, b)
}

// end finishes the held sequence: written when pass, else dropped.
func (t *termSafe) end(pass bool) {
	if pass && !t.drop {
		t.out = append(t.out, t.held...)
	}
	t.state, t.held, t.drop = tsGround, t.held[:0], false
}

func (t *termSafe) step(b byte) {
	if b == 0x05 { // ENQ, wherever it is: terminals run C0 controls mid-sequence
		return
	}
	switch t.state {
	case tsEsc:
		switch b {
		case '[':
			t.state = tsCSI
			t.hold(b)
		case ']':
			t.state = tsOSC
			t.hold(b)
		case 'P', 'X', '^', '_': // DCS, SOS, PM, APC
			t.state = tsString
		case 'Z': // DECID: the terminal answers with its attributes
			t.end(false)
		case 0x1b:
			t.begin(b)
		default:
			t.hold(b)
			t.end(true)
		}
	case tsCSI:
		switch {
		case b == 0x1b: // a new sequence aborts this one
			t.begin(b)
		case b == 0x18 || b == 0x1a: // CAN, SUB abort it
			t.end(false)
		case b >= 0x40 && b <= 0x7e:
			t.hold(b)
			t.end(!csiAsks(t.held))
		default:
			t.hold(b)
		}
	case tsOSC:
		switch b {
		case 0x07:
			t.hold(b)
			t.end(!oscAsks(t.held))
		case 0x1b:
			t.state = tsOSCEsc
		case 0x18, 0x1a:
			t.end(false)
		default:
			t.hold(b)
		}
	case tsOSCEsc:
		if b == '\\' {
			t.hold(0x1b)
			t.hold(b)
			t.end(!oscAsks(t.held))
			return
		}
		t.end(false) // an OSC cut by another sequence: dropped
		t.begin(0x1b)
		t.step(b)
	case tsString:
		if b == 0x1b {
			t.state = tsStringEsc
		} else if b == 0x18 || b == 0x1a {
			t.end(false)
		}
	case tsStringEsc:
		if b == '\\' {
			t.end(false)
			return
		}
		t.end(false)
		t.begin(0x1b)
		t.step(b)
	}
}

// csiAsks says whether a whole CSI sequence (ESC [ ... final) asks the
// terminal for an answer.
func csiAsks(seq []byte) bool {
	if len(seq) < 3 {
		return false
	}
	body, final := seq[2:len(seq)-1], seq[len(seq)-1]
	switch final {
	case 'n', 'c', 'x': // DSR, DA (primary, secondary, tertiary), DECREQTPARM
		return true
	case 't': // window manipulation: the reports answer
		first, _, _ := bytes.Cut(body, []byte(";"))
		switch n, _ := strconv.Atoi(string(first)); n {
		case 11, 13, 14, 15, 16, 18, 19, 20, 21:
			return true
		}
	case 'p': // DECRQM (CSI ? Ps $ p, CSI Ps $ p)
		return bytes.IndexByte(body, '$') >= 0
	case 'q': // XTVERSION (CSI > q)
		return bytes.IndexByte(body, '>') >= 0
	case 'u': // the keyboard protocol's query (CSI ? u)
		return bytes.IndexByte(body, '?') >= 0
	}
	return false
}

// oscAsks says whether a whole OSC sequence (ESC ] ... BEL or ST) reads
// back or writes the clipboard, files or reports, or queries a setting
// ("?").
func oscAsks(seq []byte) bool {
	body := bytes.TrimPrefix(seq, []byte("\x1b]"))
	body = bytes.TrimSuffix(bytes.TrimSuffix(body, []byte("\x07")), []byte("\x1b\\"))
	fields := bytes.Split(body, []byte(";"))
	switch string(fields[0]) {
	case "52", // the clipboard
		"46",           // xterm's log file
		"1337",         // iTerm2's: reports, uploads, the clipboard, files
		"5113", "5522": // kitty's file transfer and clipboard
		return true
	}
	for _, f := range fields[1:] {
		if string(f) == "?" {
			return true
		}
	}
	return false
}
