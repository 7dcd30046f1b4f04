package agent

import (
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
)

// portRange is an inclusive range of TCP ports.
type portRange struct{ lo, hi int }

func (r portRange) has(p int) bool { return p >= r.lo && p <= r.hi }

// The local port range a new network namespace starts with (a bridge-mode
// container's), whatever the host's is.
const netnsPortLow, netnsPortHigh = 32768, 60999

// readPortRange reads /proc/sys/net/ipv4/ip_local_port_range's form: two
// numbers, low and high.
func readPortRange(path string) (portRange, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return portRange{}, err
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return portRange{}, fmt.Errorf("%s: want two numbers, got %q", path, strings.TrimSpace(string(b)))
	}
	lo, err1 := strconv.Atoi(f[0])
	hi, err2 := strconv.Atoi(f[1])
	if err1 != nil || err2 != nil || lo > hi {
		return portRange{}, fmt.Errorf("%s: not a port range: %q", path, strings.TrimSpace(string(b)))
	}
	return portRange{lo, hi}, nil
}

// warnEphemeralPorts logs a warning for each runner port inside a range
// the kernel hands out on its own: the host's (a host-mode runner shares
// the host's ports with every outgoing connection) or a new network
// namespace's (in a bridge-mode container Docker's embedded DNS listens on
// a random one of those). Such a runner fails now and then with "address
// already in use", which looks like a broken image. Nothing is refused: a
// port in the range works most of the time, and the operator chose it.
func warnEphemeralPorts(log *slog.Logger, rangeFile string, ports map[string]int) {
	ranges := []portRange{{netnsPortLow, netnsPortHigh}}
	if r, err := readPortRange(rangeFile); err == nil {
		ranges = append(ranges, r)
	} else {
		log.Debug("cannot read the host's local port range", "err", err)
	}
	for name, p := range ports {
		for _, r := range ranges {
			if r.has(p) {
				log.Warn("a runner port lies in the kernel's ephemeral port range: some tasks' runners will fail to listen with 'address already in use'; pick a port below it",
					"flag", name, "port", p, "range", fmt.Sprintf("%d-%d", r.lo, r.hi))
				break
			}
		}
	}
}
