package fastpull

import (
	"fmt"
	"testing"
)

func TestParseContentRange(t *testing.T) {
	for _, c := range []struct {
		in   string
		want contentRange
		ok   bool
	}{
		{"bytes 0-99/100", contentRange{0, 99, 100}, true},
		{"bytes 16777216-33554431/40000000", contentRange{16777216, 33554431, 40000000}, true},
		{"bytes 5-5/6", contentRange{5, 5, 6}, true},
		{"bytes 0-99/*", contentRange{}, false},   // unknown size
		{"bytes */100", contentRange{}, false},    // an unsatisfied range
		{"bytes 10-9/100", contentRange{}, false}, // first > last
		{"bytes 0-100/100", contentRange{}, false},
		{"bytes -1-5/10", contentRange{}, false},
		{"bytes +1-5/10", contentRange{}, false},
		{"items 0-1/2", contentRange{}, false},
		{"bytes 0-1/2 ", contentRange{}, false},
		{"bytes 0-1/99999999999999", contentRange{}, false}, // past maxBlob
		{"", contentRange{}, false},
	} {
		got, err := parseContentRange(c.in)
		if (err == nil) != c.ok || got != c.want {
			t.Errorf("%q: %+v, %v; want %+v ok=%v", c.in, got, err, c.want, c.ok)
		}
	}
}

// FuzzContentRange: what parses is a span inside its size that prints
// back as the header it came from.
func FuzzContentRange(f *testing.F) {
	for _, s := range []string{"bytes 0-99/100", "bytes 1-1/2", "bytes */5", "bytes 0-0/0", "bytes 00-1/2"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		cr, err := parseContentRange(s)
		if err != nil {
			return
		}
		if cr.First < 0 || cr.First > cr.Last || cr.Last >= cr.Size || cr.Size > maxBlob {
			t.Fatalf("%q: %+v", s, cr)
		}
		var a, b, c int64
		if _, err := fmt.Sscanf(s, "bytes %d-%d/%d", &a, &b, &c); err != nil || a != cr.First || b != cr.Last || c != cr.Size {
			t.Fatalf("%q read as %+v", s, cr)
		}
	})
}
