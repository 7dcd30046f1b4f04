package api

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"strconv"
)

// DecodePull decodes a GET /api/pull answer with exactly json.Unmarshal's
// result and errors, in one pass for the shape both runners send: keys
// spelled as on the wire and messages as plain base64 strings (a repeated
// key keeps its last value, as in json).
// Every message is decoded straight into one buffer shared by the page
// (each slice capped at its own length, so an append cannot reach the
// next). Anything else (an escape, an unknown key, a null, a syntax error)
// is handed to json.Unmarshal, so the fast path never accepts what the
// standard decoder would refuse.
//
// Why: a 1 MiB page through json.Decoder is scanned twice, unquoted, then
// base64-decoded into one allocation per message; on the 2-core bench
// machine the puller took twice the runner's CPU, and the job waited on it.
func DecodePull(b []byte) (PullResponse, error) {
	d := pullDecoder{b: b}
	if out, ok := d.response(); ok {
		return out, nil
	}
	var out PullResponse
	if err := json.Unmarshal(b, &out); err != nil {
		return PullResponse{}, err
	}
	return out, nil
}

// errSlow sends the answer to json.Unmarshal.
var errSlow = errors.New("not the runner's plain shape")

// pullDecoder reads b from i. arena holds the decoded messages.
type pullDecoder struct {
	b     []byte
	i     int
	arena []byte
}

func (d *pullDecoder) response() (PullResponse, bool) {
	var out PullResponse
	d.space()
	ok := d.object(func(key []byte) bool {
		var err error
		switch string(key) {
		case "job_states":
			err = d.states(&out.JobStates)
		case "job_logs":
			out.JobLogs, err = d.logs()
		case "runner_logs":
			out.RunnerLogs, err = d.logs()
		case "last_updated":
			out.LastUpdated, err = d.int64()
		case "no_connections_secs":
			out.NoConnectionsSecs, err = d.int64()
		case "has_more":
			out.HasMore, err = d.bool()
		default:
			return false
		}
		return err == nil
	})
	return out, ok && d.end()
}

// object reads one object, calling member with each key (aliasing b) once
// the reader stands on its value; member reads the value, or returns false
// for anything it does not take. A key met twice is read twice and the
// last value stays, as json does.
func (d *pullDecoder) object(member func(key []byte) bool) bool {
	if !d.take('{') {
		return false
	}
	d.space()
	if d.take('}') {
		return true
	}
	for {
		key, ok := d.plainString()
		if !ok {
			return false
		}
		d.space()
		if !d.take(':') {
			return false
		}
		d.space()
		if !member(key) {
			return false
		}
		d.space()
		if d.take('}') {
			return true
		}
		if !d.take(',') {
			return false
		}
		d.space()
	}
}

// end: only white space may follow the object.
func (d *pullDecoder) end() bool {
	d.space()
	return d.i == len(d.b)
}

func (d *pullDecoder) space() {
	for d.i < len(d.b) {
		switch d.b[d.i] {
		case ' ', '\t', '\n', '\r':
			d.i++
		default:
			return
		}
	}
}

func (d *pullDecoder) take(c byte) bool {
	if d.i < len(d.b) && d.b[d.i] == c {
		d.i++
		return true
	}
	return false
}

// plainString reads a string without escapes or control characters and
// returns its bytes (aliasing b).
func (d *pullDecoder) plainString() ([]byte, bool) {
	if !d.take('"') {
		return nil, false
	}
	start := d.i
	for d.i < len(d.b) {
		c := d.b[d.i]
		switch {
		case c == '"':
			s := d.b[start:d.i]
			d.i++
			return s, true
		case c == '\\' || c < 0x20:
			return nil, false
		}
		d.i++
	}
	return nil, false
}

// base64String reads a string that can only be base64, finding its end
// with one vector search: base64 decoding refuses a backslash (so an
// escaped quote or any escape goes the slow way) and every control
// character but \r and \n, which it skips and JSON forbids raw, so those
// two are looked for here.
func (d *pullDecoder) base64String() ([]byte, bool) {
	if !d.take('"') {
		return nil, false
	}
	rest := d.b[d.i:]
	end := bytes.IndexByte(rest, '"')
	if end < 0 {
		return nil, false
	}
	s := rest[:end]
	if bytes.IndexByte(s, '\n') >= 0 || bytes.IndexByte(s, '\r') >= 0 {
		return nil, false
	}
	d.i += end + 1
	return s, true
}

// int64 reads an integer literal (JSON's grammar: no leading zeros, no
// fraction or exponent, which json refuses for an int64 anyway).
func (d *pullDecoder) int64() (int64, error) {
	start := d.i
	d.take('-')
	digits := d.i
	for d.i < len(d.b) && d.b[d.i] >= '0' && d.b[d.i] <= '9' {
		d.i++
	}
	n := d.i - digits
	if n == 0 || n > 1 && d.b[digits] == '0' {
		return 0, errSlow
	}
	if d.i < len(d.b) {
		if c := d.b[d.i]; c == '.' || c == 'e' || c == 'E' {
			return 0, errSlow
		}
	}
	v, err := strconv.ParseInt(string(d.b[start:d.i]), 10, 64)
	if err != nil {
		return 0, errSlow
	}
	return v, nil
}

func (d *pullDecoder) bool() (bool, error) {
	rest := d.b[d.i:]
	switch {
	case len(rest) >= 4 && string(rest[:4]) == "true":
		d.i += 4
		return true, nil
	case len(rest) >= 5 && string(rest[:5]) == "false":
		d.i += 5
		return false, nil
	}
	return false, errSlow
}

// states hands the job_states array (a few small objects) to
// json.Unmarshal: the span runs from its '[' to the bracket that closes it,
// strings skipped; if the span is not one valid array, Unmarshal says so.
func (d *pullDecoder) states(out *[]JobStateEvent) error {
	if d.i >= len(d.b) || d.b[d.i] != '[' {
		return errSlow
	}
	start, depth := d.i, 0
	for d.i < len(d.b) {
		switch d.b[d.i] {
		case '"':
			d.i++
			for d.i < len(d.b) && d.b[d.i] != '"' {
				if d.b[d.i] == '\\' {
					d.i++
				}
				d.i++
			}
		case '[', '{':
			depth++
		case ']', '}':
			depth--
			if depth == 0 {
				d.i++
				if err := json.Unmarshal(d.b[start:d.i], out); err != nil {
					return errSlow
				}
				return nil
			}
		}
		d.i++
	}
	return errSlow
}

// logs reads an array of {"message": base64, "timestamp": int}.
func (d *pullDecoder) logs() ([]LogEvent, error) {
	if !d.take('[') {
		return nil, errSlow
	}
	out := []LogEvent{}
	d.space()
	if d.take(']') {
		return out, nil
	}
	for {
		e, err := d.event()
		if err != nil {
			return nil, err
		}
		out = append(out, e)
		d.space()
		if d.take(']') {
			return out, nil
		}
		if !d.take(',') {
			return nil, errSlow
		}
		d.space()
	}
}

func (d *pullDecoder) event() (LogEvent, error) {
	var e LogEvent
	ok := d.object(func(key []byte) bool {
		switch string(key) {
		case "message":
			s, ok := d.base64String()
			if !ok {
				return false
			}
			m, err := d.decode64(s)
			e.Message = m
			return err == nil
		case "timestamp":
			v, err := d.int64()
			e.Timestamp = v
			return err == nil
		}
		return false
	})
	if !ok {
		return e, errSlow
	}
	return e, nil
}

// decode64 decodes s into the page's arena. Its first use sizes the arena
// for every message the answer can hold: decoded base64 is at most 3/4 of
// the answer's bytes.
func (d *pullDecoder) decode64(s []byte) ([]byte, error) {
	need := base64.StdEncoding.DecodedLen(len(s))
	if d.arena == nil {
		d.arena = make([]byte, 0, len(d.b)/4*3)
	}
	if cap(d.arena)-len(d.arena) < need {
		d.arena = make([]byte, 0, max(need, len(d.b)/4*3))
	}
	at := len(d.arena)
	n, err := base64.StdEncoding.Decode(d.arena[at:at+need], s)
	if err != nil {
		return nil, errSlow
	}
	d.arena = d.arena[:at+n]
	return d.arena[at : at+n : at+n], nil
}

// AppendPull appends p as json.Encoder writes it (the same bytes, the
// newline included) to dst: the messages' base64 goes straight into dst,
// without the encoder's reflection and its buffer, which grew anew for
// every 1.4 MB answer after a collection. The states (a few short
// strings, escaped the standard way) go through json.Marshal.
func AppendPull(dst []byte, p PullResponse) ([]byte, error) {
	dst = append(dst, `{"job_states":`...)
	if p.JobStates == nil {
		dst = append(dst, "null"...)
	} else {
		states, err := json.Marshal(p.JobStates)
		if err != nil {
			return dst, err
		}
		dst = append(dst, states...)
	}
	dst = append(dst, `,"job_logs":`...)
	dst = appendLogs(dst, p.JobLogs)
	dst = append(dst, `,"runner_logs":`...)
	dst = appendLogs(dst, p.RunnerLogs)
	dst = append(dst, `,"last_updated":`...)
	dst = strconv.AppendInt(dst, p.LastUpdated, 10)
	dst = append(dst, `,"no_connections_secs":`...)
	dst = strconv.AppendInt(dst, p.NoConnectionsSecs, 10)
	dst = append(dst, `,"has_more":`...)
	dst = strconv.AppendBool(dst, p.HasMore)
	return append(dst, "}\n"...), nil
}

// PullSize is about what AppendPull writes for p, to size its buffer.
func PullSize(p PullResponse) int {
	n := 256 + 128*len(p.JobStates)
	for _, l := range [][]LogEvent{p.JobLogs, p.RunnerLogs} {
		for _, e := range l {
			n += 48 + base64.StdEncoding.EncodedLen(len(e.Message))
		}
	}
	return n
}

func appendLogs(dst []byte, l []LogEvent) []byte {
	if l == nil {
		return append(dst, "null"...)
	}
	dst = append(dst, '[')
	for i, e := range l {
		if i > 0 {
			dst = append(dst, ',')
		}
		dst = append(dst, `{"message":`...)
		if e.Message == nil {
			dst = append(dst, "null"...)
		} else {
			dst = append(dst, '"')
			dst = base64.StdEncoding.AppendEncode(dst, e.Message)
			dst = append(dst, '"')
		}
		dst = append(dst, `,"timestamp":`...)
		dst = strconv.AppendInt(dst, e.Timestamp, 10)
		dst = append(dst, '}')
	}
	return append(dst, ']')
}
