package api

import (
	"bytes"
	"encoding/json"
	"io"
	"reflect"
	"slices"
	"testing"
)

// pullPage is an answer as the runner encodes it: n job chunks of size
// bytes each, one runner log, one state.
func pullPage(tb testing.TB, n, size int) []byte {
	tb.Helper()
	p := PullResponse{
		JobStates:   []JobStateEvent{{State: JobRunning, Timestamp: 1700000000001}},
		JobLogs:     []LogEvent{},
		RunnerLogs:  []LogEvent{{Message: []byte("runner: started\n"), Timestamp: 1700000000002}},
		LastUpdated: 1700000000999, NoConnectionsSecs: 3, HasMore: true,
	}
	for i := range n {
		p.JobLogs = append(p.JobLogs, LogEvent{Message: bytes.Repeat([]byte{byte('a' + i%26), '\r', '\n', 0x1b}, size/4), Timestamp: int64(1700000000003 + i)})
	}
	var buf bytes.Buffer
	if err := json.NewEncoder(&buf).Encode(p); err != nil {
		tb.Fatal(err)
	}
	return buf.Bytes()
}

// samePull asserts DecodePull's result and error agree with json.Unmarshal.
func samePull(t *testing.T, b []byte) (PullResponse, error) {
	t.Helper()
	got, err := DecodePull(b)
	var want PullResponse
	werr := json.Unmarshal(b, &want)
	if (err == nil) != (werr == nil) {
		t.Fatalf("%q: DecodePull error %v, json.Unmarshal error %v", b, err, werr)
	}
	if err != nil {
		if err.Error() != werr.Error() {
			t.Fatalf("%q: error %q, json says %q", b, err, werr)
		}
		return got, err
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("%q:\n got %+v\nwant %+v", b, got, want)
	}
	// Messages may share a buffer: an append to one must not reach another.
	all := append(slices.Clone(got.JobLogs), got.RunnerLogs...)
	before := make([][]byte, len(all))
	for i, e := range all {
		before[i] = bytes.Clone(e.Message)
	}
	for i := range all {
		_ = append(all[i].Message, "\xff\xff\xff\xff"...)
	}
	for i, e := range all {
		if !bytes.Equal(e.Message, before[i]) {
			t.Fatalf("message %d changed when the others were appended to", i)
		}
	}
	return got, nil
}

func TestDecodePullMatchesEncodingJSON(t *testing.T) {
	page := pullPage(t, 40, 4096)
	got, err := samePull(t, page)
	if err != nil || len(got.JobLogs) != 40 || !got.HasMore || got.JobStates[0].State != JobRunning {
		t.Fatalf("the runner's own page: %+v %v", got, err)
	}
	for _, in := range []string{
		`{}`, ` {"job_logs":[]} `, `{"job_logs":null}`, `null`, ``, `[]`,
		`{"job_logs":[{}]}`, `{"job_logs":[{"message":""}]}`, `{"job_logs":[{"message":null}]}`,
		`{"job_logs":[{"message":"aGk="},{"timestamp":-0,"message":"aGk="}]}`,
		`{"job_logs":[{"message":"aGk"}]}`,                   // bad base64: json's own error
		`{"job_logs":[{"message":"aG\u0073="}]}`,             // an escape: json decodes it
		`{"job_logs":[{"message":"aGk=","message":"aGk="}]}`, // duplicate key: the last wins
		`{"Job_Logs":[{"Message":"aGk="}]}`,                  // json matches keys without case
		`{"job_logs":[{"message":"aGk=","extra":[1,{"a":"]"}]}]}`,
		`{"last_updated":12,"last_updated":13}`, `{"job_logs":[{"message":"aGk=","message":"eW8=","timestamp":1}]}`,
		`{"job_logs":[{"message":"aGk="}],"job_logs":[]}`, `{"job_logs":[],"job_logs":[{"message":"aGk="}]}`,
		`{"job_states":[{"state":"done"}],"job_states":[]}`, `{"has_more":true,"has_more":false}`, `{"last_updated":1.5}`, `{"last_updated":1e3}`,
		`{"last_updated":01}`, `{"last_updated":-}`, `{"last_updated":9223372036854775808}`,
		`{"last_updated":-9223372036854775808}`, `{"has_more":true}`, `{"has_more":tru}`, `{"has_more":null}`,
		`{"job_states":[{"state":"done","timestamp":5,"termination_reason":"","termination_message":"\"]"}]}`,
		`{"job_states":[}`, `{"job_states":[{"state":"x"}]]}`, `{"job_states":"x"}`, `{"job_states":[`,
		`{"job_logs":[]}x`, `{"job_logs":[],}`, `{"job_logs":[,]}`, `{"job_logs":[{"message":"aGk=",}]}`,
		"{\"job_logs\":[{\"message\":\"a\tGk=\"}]}", // raw control characters: invalid JSON
		"{\"job_logs\":[{\"message\":\"aG\nk=\"}]}", "{\"job_logs\":[{\"message\":\"aG\rk=\"}]}",
		`{"job_logs":[{"message":"aGk\"="}]}`, `{"job_logs":[{"message":"aGk=\n"}]}`, `{"job_logs":[{"message":"aGk=`, `{"job_logs":[{"message":"aGk="}]`,
		`{"no_connections_secs":0,"has_more":false,"runner_logs":[{"timestamp":1}]}`,
	} {
		samePull(t, []byte(in))
	}
}

// AppendPull writes json.Encoder's bytes: nil and empty lists and
// messages, escapes in the states, extreme numbers.
func TestAppendPullIsEncodingJSON(t *testing.T) {
	for _, p := range []PullResponse{
		{},
		{JobStates: []JobStateEvent{}, JobLogs: []LogEvent{}, RunnerLogs: []LogEvent{}},
		{JobStates: []JobStateEvent{{State: JobFailed, Timestamp: -1, TerminationReason: "x<y>&", TerminationMessage: "\"\x00\u2028\xff"}},
			JobLogs:    []LogEvent{{}, {Message: []byte{}}, {Message: []byte("\x1b[31mred\r\n"), Timestamp: 1<<63 - 1}},
			RunnerLogs: []LogEvent{{Message: []byte{0, 1, 2}, Timestamp: -1 << 63}}, LastUpdated: 7, NoConnectionsSecs: -3, HasMore: true},
	} {
		var want bytes.Buffer
		if err := json.NewEncoder(&want).Encode(p); err != nil {
			t.Fatal(err)
		}
		got, err := AppendPull([]byte("prefix"), p)
		if err != nil || string(got) != "prefix"+want.String() {
			t.Fatalf("%+v: %v\n got %q\nwant %q", p, err, got, want.String())
		}
		if n := PullSize(p); n < len(got)-len("prefix") {
			t.Fatalf("PullSize %d under the %d bytes written", n, len(got)-len("prefix"))
		}
	}
	page := pullPage(t, 40, 4096)
	p, err := DecodePull(page)
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := AppendPull(nil, p); !bytes.Equal(got, page) {
		t.Fatal("the runner's page does not encode back to itself")
	}
}

func TestDecodePullRefusesWhatJSONRefuses(t *testing.T) {
	for _, in := range []string{`{"job_logs":[{"message":"aGk"}]}`, `{"job_logs":[]}x`, `{"last_updated":1.5}`, `{`} {
		if _, err := samePull(t, []byte(in)); err == nil {
			t.Fatalf("%s: accepted", in)
		}
	}
}

func FuzzDecodePull(f *testing.F) {
	f.Add(pullPage(f, 3, 64))
	f.Add([]byte(`{"job_logs":[{"message":"aGk=","timestamp":1}],"has_more":false}`))
	f.Add([]byte(`{"job_states":[{"state":"done","timestamp":5}],"runner_logs":[]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		got, err := samePull(t, b)
		if err != nil {
			return
		}
		// What decoded encodes back byte for byte as json.Encoder would.
		var want bytes.Buffer
		if err := json.NewEncoder(&want).Encode(got); err != nil {
			t.Fatal(err)
		}
		enc, err := AppendPull(nil, got)
		if err != nil || !bytes.Equal(enc, want.Bytes()) {
			t.Fatalf("AppendPull: %v\n got %q\nwant %q", err, enc, want.Bytes())
		}
		// Decoded messages never exceed the answer that carried them.
		total := 0
		for _, e := range append(got.JobLogs, got.RunnerLogs...) {
			total += len(e.Message)
		}
		if total > len(b) {
			t.Fatalf("%d message bytes out of a %d-byte answer", total, len(b))
		}
	})
}

// BenchmarkDecodePull: one 1 MiB page (the runner's pull cap) of 4 KiB
// chunks, against json.Decoder as the client used it before.
func BenchmarkDecodePull(b *testing.B) {
	page := pullPage(b, 256, 4096)
	b.Run("DecodePull", func(b *testing.B) {
		b.SetBytes(int64(len(page)))
		for b.Loop() {
			if _, err := DecodePull(page); err != nil {
				b.Fatal(err)
			}
		}
	})
	p, err := DecodePull(page)
	if err != nil {
		b.Fatal(err)
	}
	b.Run("AppendPull", func(b *testing.B) {
		b.SetBytes(int64(len(page)))
		buf := make([]byte, 0, PullSize(p))
		for b.Loop() {
			if buf, err = AppendPull(buf[:0], p); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("json.Encoder", func(b *testing.B) {
		b.SetBytes(int64(len(page)))
		for b.Loop() {
			if err := json.NewEncoder(io.Discard).Encode(p); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("json.Decoder", func(b *testing.B) {
		b.SetBytes(int64(len(page)))
		for b.Loop() {
			var p PullResponse
			if err := json.NewDecoder(bytes.NewReader(page)).Decode(&p); err != nil {
				b.Fatal(err)
			}
		}
	})
}
