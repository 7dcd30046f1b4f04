package cli

import (
	"strings"

	"github.com/urfave/cli/v2"
)

// whole is a repeatable flag's values, each taken whole: urfave's
// StringSlice splits every value at its commas, so `-e LIST=a,b` became
// LIST=a and a bad "b", and a key whose options hold a comma
// (from="10.0.0.1,10.0.0.2") broke in two.
type whole []string

func (w *whole) Set(v string) error { *w = append(*w, v); return nil }
func (w *whole) String() string {
	if w == nil {
		return ""
	}
	return strings.Join(*w, " ")
}

// wholeFlags are repeatable flags, one per name, that share one list: a
// value given under any of them is appended in command-line order (--env
// and -e mixed: the later pair wins as written).
func wholeFlags(usage string, names ...string) []cli.Flag {
	w := new(whole)
	out := make([]cli.Flag, len(names))
	for i, n := range names {
		out[i] = &cli.GenericFlag{Name: n, Value: w, Usage: usage}
	}
	return out
}

// wholeValues is the list behind the whole flag name (nil when unset).
func wholeValues(c *cli.Context, name string) []string {
	if w, ok := c.Generic(name).(*whole); ok && w != nil {
		return *w
	}
	return nil
}
