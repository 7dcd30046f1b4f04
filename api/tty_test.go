package api

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

func TestTermSizeCheck(t *testing.T) {
	for _, tc := range []struct {
		name string
		s    TermSize
		ok   bool
	}{
		{"smallest", TermSize{1, 1}, true},
		{"usual", TermSize{24, 80}, true},
		{"largest", TermSize{MaxTermSide, MaxTermSide}, true},
		{"zero rows", TermSize{0, 80}, false},
		{"zero cols", TermSize{24, 0}, false},
		{"negative", TermSize{-1, 80}, false},
		{"rows past the bound", TermSize{MaxTermSide + 1, 80}, false},
		{"cols past the bound", TermSize{24, MaxTermSide + 1}, false},
		{"past 16 bits", TermSize{24, 1 << 16}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.s.Check()
			if (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrBadTermSize)) {
				t.Fatalf("Check(%+v) = %v, want ok %v", tc.s, err, tc.ok)
			}
		})
	}
}

func TestParseStdinControl(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   string
		want *TermSize // nil: refused
	}{
		{"resize", `{"resize":{"rows":40,"cols":120}}`, &TermSize{40, 120}},
		{"spaces around", " {\"resize\": {\"rows\": 1, \"cols\": 10000}}\n", &TermSize{1, 10000}},
		{"empty", ``, nil},
		{"null", `null`, nil},
		{"empty object", `{}`, nil},
		{"resize null", `{"resize":null}`, nil},
		{"zero size", `{"resize":{"rows":0,"cols":0}}`, nil},
		{"too many rows", `{"resize":{"rows":10001,"cols":80}}`, nil},
		{"negative cols", `{"resize":{"rows":24,"cols":-80}}`, nil},
		{"huge number", `{"resize":{"rows":1e30,"cols":80}}`, nil},
		{"fraction", `{"resize":{"rows":2.5,"cols":80}}`, nil},
		{"string", `{"resize":{"rows":"24","cols":80}}`, nil},
		{"unknown field", `{"resize":{"rows":24,"cols":80},"signal":"INT"}`, nil},
		{"unknown size field", `{"resize":{"rows":24,"cols":80,"x":1}}`, nil},
		{"two objects", `{"resize":{"rows":24,"cols":80}}{"resize":{"rows":24,"cols":80}}`, nil},
		{"trailing garbage", `{"resize":{"rows":24,"cols":80}} x`, nil},
		{"not JSON", "\x00\xff", nil},
		{"too long", `{"resize":{"rows":24,"cols":80}}` + strings.Repeat(" ", MaxStdinControl), nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := ParseStdinControl([]byte(tc.in))
			switch {
			case tc.want == nil && err == nil:
				t.Fatalf("%q: accepted as %+v", tc.in, c.Resize)
			case tc.want == nil && !errors.Is(err, ErrBadStdinControl):
				t.Fatalf("%q: %v is not ErrBadStdinControl", tc.in, err)
			case tc.want != nil && err != nil:
				t.Fatalf("%q: %v", tc.in, err)
			case tc.want != nil && *c.Resize != *tc.want:
				t.Fatalf("%q: %+v, want %+v", tc.in, *c.Resize, *tc.want)
			}
		})
	}
}

// FuzzParseStdinControl: whatever a client sends, a message accepted is at
// most MaxStdinControl bytes and holds a size in bounds, which encodes
// back to a message accepted as the same size.
func FuzzParseStdinControl(f *testing.F) {
	f.Add([]byte(`{"resize":{"rows":40,"cols":120}}`))
	f.Add([]byte(`{"resize":{"rows":0,"cols":99999}}`))
	f.Add([]byte(`{"resize":{"rows":1e3,"cols":80},"x":[]}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := ParseStdinControl(b)
		if err != nil {
			if !errors.Is(err, ErrBadStdinControl) {
				t.Fatalf("%q: %v is not ErrBadStdinControl", b, err)
			}
			return
		}
		if len(b) > MaxStdinControl {
			t.Fatalf("accepted %d bytes, the bound is %d", len(b), MaxStdinControl)
		}
		if c.Resize == nil || c.Resize.Check() != nil {
			t.Fatalf("%q: accepted %+v", b, c.Resize)
		}
		out, err := json.Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		again, err := ParseStdinControl(out)
		if err != nil || *again.Resize != *c.Resize {
			t.Fatalf("own encoding %s: %+v %v", out, again.Resize, err)
		}
	})
}
