package logs

import (
	"bytes"
	"encoding/binary"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode/utf8"
)

// The bounds of the virtual screen (see Stripper).
const (
	MaxColumns = 4096
	MaxRowMove = 256
	MaxParam   = 65535
)

// Stripper turns terminal output into plain lines, like a tiny virtual
// screen: it interprets \r, \b, \n, cursor movement and erase sequences,
// drops colours and modes, and emits only completed lines (the cursor moved
// below them). A progress bar redrawn with \r collapses to its state at
// flush time. Each flush hands one chunk of lines to emit.
//
// Flushes happen after IdleFlush without output, every ForceFlush while
// output keeps coming, when the buffered screen exceeds MaxBuffer, and on
// Close (which also emits the unfinished last line).
//
// Plain lines (printable ASCII ended by \n or \r\n) that start at the
// bottom of the screen, its cursor at the start of an empty line, skip the
// screen's runes: they are queued as text for the next flush, with the
// completed lines above them. That is most of what jobs print, and costs a
// scan and a copy (4x the screen's pace). The queue is still part of the
// screen: a cursor move up (or home, or a clear of the screen) that
// reaches into it takes the lines it needs back first, so what is emitted
// is what the screen alone would emit. Taking lines back is bounded: past
// MaxBuffer bytes taken back between two flushes, plain lines go through
// the screen until the next flush.
//
// Memory is bounded whatever the job prints. The screen is a terminal of
// MaxColumns columns: cursor movement never goes past column MaxColumns-1 or
// more than MaxRowMove rows down per sequence, a sequence with a parameter
// above MaxParam is ignored as garbage, and the budget (runes plus one per
// buffered line, padding included) is checked after every step, not once
// per write. Text itself is not wrapped: a longer line is emitted in pieces
// once it fills the budget.
type Stripper struct {
	emit func([]byte)

	IdleFlush  time.Duration
	ForceFlush time.Duration
	MaxBuffer  int

	mu      sync.Mutex // guards everything below
	lines   [][]rune   // screen lines not yet emitted
	row     int        // cursor row within lines
	col     int
	pending []byte // incomplete escape sequence or UTF-8 rune
	size    int
	idle    *time.Timer
	force   *time.Timer
	closed  bool
	// idleArmed: the idle timer runs; lastWrite: when output last came.
	idleArmed bool
	lastWrite time.Time
	// free holds emitted lines' buffers for reuse (at most freeRunes runes
	// in all), so steady output allocates almost nothing per line.
	free      [][]rune
	freeRunes int
	// out holds settled lines for the next flush, the chunk handed to
	// emit, reused from flush to flush (a new one per flush was half of
	// what the log pipeline allocated).
	out []byte
	// churn: bytes of out taken back onto the screen since the last flush.
	churn int
	// screenOnly sends plain lines through the screen too (the tests'
	// reference).
	screenOnly bool
}

// maxFreeRunes bounds the recycled line buffers (1 MiB of runes).
const maxFreeRunes = 256 << 10

// NewStripper returns a stripper calling emit (serially) with each chunk.
// The chunk is the stripper's until emit returns: emit copies what it keeps.
func NewStripper(emit func([]byte)) *Stripper {
	return &Stripper{emit: emit, IdleFlush: 500 * time.Millisecond, ForceFlush: 3 * time.Second, MaxBuffer: 32 << 10, lines: [][]rune{nil}, size: 1}
}

// Write feeds terminal output.
func (s *Stripper) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return len(p), nil
	}
	data := p
	if len(s.pending) > 0 {
		data = append(s.pending, p...)
		s.pending = nil
	}
	s.feed(data)
	s.armTimers()
	return len(p), nil
}

// bound flushes when the buffered screen is over budget, or the settled
// text over its own.
func (s *Stripper) bound() {
	if s.size <= s.MaxBuffer && len(s.out) < s.outBudget() {
		return
	}
	s.flushLocked(false)
	if s.size > s.MaxBuffer {
		// One endless line: emit it in pieces rather than buffer it all.
		s.flushLocked(true)
	}
}

// armTimers notes a write for the idle flush and starts the force flush.
// The idle timer is not reset on every write (a timer operation per pty
// read showed in profiles): it fires, and re-arms for the rest of the idle
// time when output came meanwhile.
func (s *Stripper) armTimers() {
	s.lastWrite = time.Now()
	if s.idle == nil {
		s.idle = time.AfterFunc(s.IdleFlush, s.idleFire)
	} else if !s.idleArmed {
		s.idle.Reset(s.IdleFlush)
	}
	s.idleArmed = true
	if s.force == nil {
		s.force = time.AfterFunc(s.ForceFlush, func() {
			s.Flush()
			s.mu.Lock()
			s.force = nil
			s.mu.Unlock()
		})
	}
}

func (s *Stripper) idleFire() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	if rest := s.IdleFlush - time.Since(s.lastWrite); rest > 0 {
		s.idle.Reset(rest)
		return
	}
	s.idleArmed = false
	s.flushLocked(false)
}

// Flush emits completed lines now.
func (s *Stripper) Flush() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.flushLocked(false)
}

// Close emits everything, the unfinished line included; later writes are dropped.
func (s *Stripper) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	if s.idle != nil {
		s.idle.Stop()
	}
	if s.force != nil {
		s.force.Stop()
	}
	s.flushLocked(true)
	s.closed = true
	return nil
}

func (s *Stripper) flushLocked(all bool) {
	if s.closed {
		return
	}
	s.settleLocked(all)
	if len(s.out) == 0 {
		return
	}
	out := s.out
	s.churn = 0
	s.emit(out)
	if cap(out) <= maxOut {
		s.out = out[:0]
	} else {
		s.out = nil // a rare huge flush is not held on to
	}
}

// maxOut bounds the emit buffer the stripper keeps between flushes.
const maxOut = 256 << 10

// settleLocked moves the completed lines of the screen (all: every line)
// into out, as plain text.
func (s *Stripper) settleLocked(all bool) {
	upto := s.row
	if all {
		upto = len(s.lines)
		if len(s.lines[len(s.lines)-1]) == 0 {
			upto-- // nothing after the last newline
		}
	}
	if upto <= 0 {
		return
	}
	n := len(s.out)
	for _, l := range s.lines[:upto] {
		n += len(l) + 1
	}
	out := slices.Grow(s.out, n-len(s.out)) // exact for ASCII
	for _, l := range s.lines[:upto] {
		end := len(l)
		for end > 0 && (l[end-1] == ' ' || l[end-1] == 0) {
			end--
		}
		l = l[:end]
		// ASCII (the common case) is copied by index into room made once.
		out = slices.Grow(out, len(l)+1) // room even after multi-byte runes
		k := len(out)
		out = out[:k+len(l)]
		i := narrow(out[k:k+len(l)], l)
		out = out[:k+i]
		for _, r := range l[i:] {
			out = utf8.AppendRune(out, r)
		}
		out = append(out, '\n')
		if c := cap(l); c > 0 && s.freeRunes+c <= maxFreeRunes {
			s.free = append(s.free, l[:0])
			s.freeRunes += c
		}
	}
	s.out = out
	rest := s.lines[upto:]
	s.lines = append(s.lines[:0], rest...)
	if len(s.lines) == 0 {
		s.lines = [][]rune{nil}
	}
	s.row -= upto
	if s.row < 0 {
		s.row, s.col = 0, 0
	}
	s.size = len(s.lines)
	for _, l := range s.lines {
		s.size += len(l)
	}
}

// plainLines takes the plain lines at the start of p, the cursor being at
// the start of the empty bottom line: each is printable ASCII shorter than
// half the budget (a longer one would be cut in pieces by the screen) and
// ends with \n or \r\n, which from there leaves what it printed as its
// line. The screen's completed lines are settled first, so the order
// holds. Returns the bytes taken.
func (s *Stripper) plainLines(p []byte) int {
	taken := 0
	for taken < len(p) {
		k := printableRun(p[taken:])
		e := taken + k
		nl := 0
		switch {
		case k >= s.MaxBuffer/2:
		case e < len(p) && p[e] == '\n':
			nl = 1
		case e+1 < len(p) && p[e] == '\r' && p[e+1] == '\n':
			nl = 2
		}
		if nl == 0 {
			break
		}
		if taken == 0 {
			s.settleLocked(false)
		}
		line := p[taken:e]
		for len(line) > 0 && line[len(line)-1] == ' ' {
			line = line[:len(line)-1]
		}
		s.out = append(append(s.out, line...), '\n')
		taken = e + nl
		if len(s.out) >= s.outBudget() {
			s.flushLocked(false)
		}
	}
	return taken
}

// outBudget is how much settled text waits for a flush: four times the
// screen's budget, as its bytes take a quarter of a rune's room. Fewer,
// bigger chunks mean fewer writes to the job log, each a system call that
// woke the runtime's monitor (32 -> 8 writes per MiB of plain lines); a
// chunk stays far under the 256 KiB a dstack server's CloudWatch storage
// takes as one event.
func (s *Stripper) outBudget() int { return 4 * s.MaxBuffer }

// unsettle takes the last k lines of out (fewer when it holds fewer) back
// onto the top of the screen, as they were; returns how many it took.
func (s *Stripper) unsettle(k int) int {
	if k <= 0 || len(s.out) == 0 {
		return 0
	}
	from, n := len(s.out)-1, 0 // out ends with a newline
	for n < k && from >= 0 {
		from = bytes.LastIndexByte(s.out[:from], '\n')
		n++
	}
	seg := s.out[from+1:]
	back := make([][]rune, 0, n+len(s.lines))
	for len(seg) > 0 {
		nl := bytes.IndexByte(seg, '\n')
		text := seg[:nl]
		line := make([]rune, 0, len(text))
		for len(text) > 0 {
			if i := printableRun(text); i > 0 {
				line = line[:len(line)+i]
				widen(line[len(line)-i:], text[:i])
				text = text[i:]
				continue
			}
			r, size := utf8.DecodeRune(text)
			line = append(line, r)
			text = text[size:]
		}
		back = append(back, line)
		s.size += len(line) + 1
		seg = seg[nl+1:]
	}
	s.churn += len(s.out) - (from + 1)
	s.out = s.out[:from+1]
	s.lines = append(back, s.lines...)
	s.row += n
	return n
}

func (s *Stripper) feed(p []byte) {
	for i := 0; i < len(p); s.bound() {
		if s.col == 0 && s.row == len(s.lines)-1 && len(s.lines[s.row]) == 0 && s.churn <= s.MaxBuffer && !s.screenOnly {
			if n := s.plainLines(p[i:]); n > 0 {
				i += n
				continue
			}
		}
		b := p[i]
		switch {
		case b == 0x1b:
			n, complete := s.escape(p[i:])
			if !complete {
				s.pending = append([]byte(nil), p[i:]...)
				return
			}
			i += n
		case b == '\n':
			s.down(1)
			s.col = 0
			i++
		case b == '\r':
			s.col = 0
			i++
		case b == '\b':
			if s.col > 0 {
				s.col--
			}
			i++
		case b == '\t':
			s.put(' ')
			for s.col%8 != 0 {
				s.put(' ')
			}
			i++
		case b < 0x20 || b == 0x7f:
			i++ // other controls: bell, shift-in/out, ...
		case b < utf8.RuneSelf:
			// Fast path: a run of printable ASCII at the end of the line.
			j := i + printableRun(p[i:])
			line := s.lines[s.row]
			if s.col == len(line) {
				k := len(line)
				line = slices.Grow(line, j-i)[:k+j-i]
				widen(line[k:], p[i:j])
				s.lines[s.row] = line
				s.size += j - i
				s.col += j - i
				i = j
				continue
			}
			s.put(rune(b))
			i++
		default:
			if !utf8.FullRune(p[i:]) {
				s.pending = append([]byte(nil), p[i:]...)
				return
			}
			r, n := utf8.DecodeRune(p[i:])
			if r != utf8.RuneError {
				s.put(r)
			}
			i += n
		}
	}
}

// printableRun returns how many bytes at the start of p are printable
// ASCII (0x20-0x7e), eight at a time where it can: the stripper's hot loop.
func printableRun(p []byte) int {
	const ones, highs = 0x0101010101010101, 0x8080808080808080
	i := 0
	for ; i+8 <= len(p); i += 8 {
		v := binary.LittleEndian.Uint64(p[i:])
		// A byte is out when it has the high bit, is below 0x20, or is
		// 0x7f: below 0x20 shows as a borrow into its high bit; 0x7f is
		// the one byte that becomes 0x80 when 1 is added.
		if (v|(v-0x20*ones)|(v+ones))&highs != 0 {
			break
		}
	}
	for i < len(p) && p[i] >= 0x20 && p[i] < 0x7f {
		i++
	}
	return i
}

// widen copies ASCII bytes into runes; len(dst) == len(src).
func widen(dst []rune, src []byte) {
	dst = dst[:len(src)]
	i := 0
	for ; i+8 <= len(src); i += 8 {
		d, s := dst[i:i+8:i+8], src[i:i+8:i+8]
		d[0], d[1], d[2], d[3] = rune(s[0]), rune(s[1]), rune(s[2]), rune(s[3])
		d[4], d[5], d[6], d[7] = rune(s[4]), rune(s[5]), rune(s[6]), rune(s[7])
	}
	for ; i < len(src); i++ {
		dst[i] = rune(src[i])
	}
}

// narrow copies the leading ASCII runes of src into dst (len(dst) ≥
// len(src)) and returns how many it copied.
func narrow(dst []byte, src []rune) int {
	dst = dst[:len(src)]
	i := 0
	for ; i+8 <= len(src); i += 8 {
		s, d := src[i:i+8:i+8], dst[i:i+8:i+8]
		if (s[0] | s[1] | s[2] | s[3] | s[4] | s[5] | s[6] | s[7]) >= utf8.RuneSelf {
			break
		}
		d[0], d[1], d[2], d[3] = byte(s[0]), byte(s[1]), byte(s[2]), byte(s[3])
		d[4], d[5], d[6], d[7] = byte(s[4]), byte(s[5]), byte(s[6]), byte(s[7])
	}
	for ; i < len(src) && src[i] < utf8.RuneSelf; i++ {
		dst[i] = byte(src[i])
	}
	return i
}

func (s *Stripper) put(r rune) {
	line := s.lines[s.row]
	if pad := s.col - len(line); pad > 0 {
		line = append(line, make([]rune, pad)...)
		for i := len(line) - pad; i < len(line); i++ {
			line[i] = ' '
		}
		s.size += pad
	}
	if s.col < len(line) {
		line[s.col] = r
	} else {
		line = append(line, r)
		s.size++
	}
	s.lines[s.row] = line
	s.col++
}

// escape interprets the sequence at the start of p and returns its length,
// or complete=false when p ends inside it.
func (s *Stripper) escape(p []byte) (int, bool) {
	if len(p) < 2 {
		return 0, false
	}
	switch p[1] {
	case '[':
		for j := 2; j < len(p); j++ {
			c := p[j]
			if c >= 0x40 && c <= 0x7e {
				s.csi(string(p[2:j]), c)
				return j + 1, true
			}
			if j > 64 { // not a real sequence: drop the ESC
				return 1, true
			}
		}
		return 0, false
	case ']', 'P', '_', '^': // OSC / DCS / APC / PM: until BEL or ST
		for j := 2; j < len(p); j++ {
			if p[j] == 0x07 {
				return j + 1, true
			}
			if p[j] == 0x1b && j+1 < len(p) && p[j+1] == '\\' {
				return j + 2, true
			}
			if j > 4096 {
				return j, true
			}
		}
		return 0, false
	case '(', ')', '*', '+':
		if len(p) < 3 {
			return 0, false
		}
		return 3, true
	}
	return 2, true
}

func (s *Stripper) csi(params string, final byte) {
	args := []int{}
	for _, f := range strings.Split(params, ";") {
		f = strings.TrimLeft(f, "?>=")
		n := 0
		for _, c := range []byte(f) {
			if c < '0' || c > '9' {
				n = 0 // not a number: the default
				break
			}
			if n = n*10 + int(c-'0'); n > MaxParam {
				return // absurd: no terminal acts on it
			}
		}
		args = append(args, n)
	}
	arg := func(i, def int) int {
		if i < len(args) && args[i] > 0 {
			return args[i]
		}
		return def
	}
	switch final {
	case 'A':
		s.unsettle(arg(0, 1) - s.row)
		s.row = max(s.row-arg(0, 1), 0)
	case 'B':
		s.down(arg(0, 1))
	case 'C':
		s.col = max(s.col, min(s.col+arg(0, 1), MaxColumns-1))
	case 'D':
		s.col = max(s.col-arg(0, 1), 0)
	case 'G':
		s.col = min(arg(0, 1), MaxColumns) - 1
	case 'H', 'f':
		s.unsettle(len(s.out))
		s.row = 0
		s.down(arg(0, 1) - 1)
		s.col = min(arg(1, 1), MaxColumns) - 1
	case 'K':
		line := s.lines[s.row]
		switch arg(0, 0) {
		case 0:
			if s.col < len(line) {
				s.lines[s.row] = line[:s.col]
			}
		case 1:
			for i := 0; i < s.col && i < len(line); i++ {
				line[i] = ' '
			}
		case 2:
			s.lines[s.row] = nil
		}
	case 'J':
		switch arg(0, 0) {
		case 0:
			if s.col < len(s.lines[s.row]) {
				s.lines[s.row] = s.lines[s.row][:s.col]
			}
			for i := s.row + 1; i < len(s.lines); i++ {
				s.lines[i] = nil
			}
		case 2, 3:
			s.unsettle(len(s.out))
			for i := range s.lines {
				s.lines[i] = nil
			}
		}
	}
	// m (colours), h/l (modes) and the rest: dropped.
}

// down moves the cursor n rows down (at most MaxRowMove), adding lines.
func (s *Stripper) down(n int) {
	s.row += min(n, MaxRowMove)
	for s.row >= len(s.lines) {
		var l []rune
		if k := len(s.free); k > 0 {
			l = s.free[k-1]
			s.free = s.free[:k-1]
			s.freeRunes -= cap(l)
		}
		s.lines = append(s.lines, l)
		s.size++
	}
}
