// Package portrange reads the kernel's local (ephemeral) port range: the
// ports it picks for a socket that binds or connects without naming one.
package portrange

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Range is an inclusive range of ports.
type Range struct{ Low, High int }

// Has says whether p lies in r.
func (r Range) Has(p int) bool { return p >= r.Low && p <= r.High }

func (r Range) String() string { return fmt.Sprintf("%d-%d", r.Low, r.High) }

// HostFile is where Linux keeps the range of the reader's network namespace.
const HostFile = "/proc/sys/net/ipv4/ip_local_port_range"

// NetnsDefault is the range a new network namespace starts with (a
// bridge-mode container's), whatever the host's is.
func NetnsDefault() Range { return Range{32768, 60999} }

// Read reads a range in ip_local_port_range's form: two numbers, low and
// high.
func Read(path string) (Range, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return Range{}, err
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return Range{}, fmt.Errorf("%s: want two numbers, got %q", path, strings.TrimSpace(string(b)))
	}
	lo, err1 := strconv.Atoi(f[0])
	hi, err2 := strconv.Atoi(f[1])
	if err1 != nil || err2 != nil || lo > hi {
		return Range{}, fmt.Errorf("%s: not a port range: %q", path, strings.TrimSpace(string(b)))
	}
	return Range{lo, hi}, nil
}
