package fastpull

import (
	"fmt"
	"strconv"
	"strings"
)

// contentRange is a parsed "Content-Range: bytes first-last/size" answer.
type contentRange struct {
	First, Last, Size int64
}

// maxBlob bounds what a registry may claim a blob's size is (1 TiB):
// offsets past it are refused before any arithmetic on them.
const maxBlob = 1 << 40

// parseContentRange reads a 206's Content-Range strictly: the bytes unit,
// first <= last < size, all decimal digits, no unknown ("*") size.
func parseContentRange(s string) (contentRange, error) {
	rest, ok := strings.CutPrefix(s, "bytes ")
	if !ok {
		return contentRange{}, fmt.Errorf("content-range %q: not a bytes range", s)
	}
	span, size, ok := strings.Cut(rest, "/")
	if !ok {
		return contentRange{}, fmt.Errorf("content-range %q: no size", s)
	}
	first, last, ok := strings.Cut(span, "-")
	if !ok {
		return contentRange{}, fmt.Errorf("content-range %q: no span", s)
	}
	var cr contentRange
	var err error
	for _, f := range []struct {
		s string
		p *int64
	}{{first, &cr.First}, {last, &cr.Last}, {size, &cr.Size}} {
		if *f.p, err = decimal(f.s); err != nil {
			return contentRange{}, fmt.Errorf("content-range %q: %w", s, err)
		}
	}
	if cr.First > cr.Last || cr.Last >= cr.Size {
		return contentRange{}, fmt.Errorf("content-range %q: span outside the size", s)
	}
	return cr, nil
}

func decimal(s string) (int64, error) {
	if s == "" || len(s) > 13 {
		return 0, fmt.Errorf("bad number %q", s)
	}
	for _, c := range s {
		if c < '0' || c > '9' {
			return 0, fmt.Errorf("bad number %q", s)
		}
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n > maxBlob {
		return 0, fmt.Errorf("bad number %q", s)
	}
	return n, nil
}
