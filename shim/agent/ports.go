package agent

import (
	"log/slog"

	"github.com/tandem-run/tandem/common/portrange"
)

// warnEphemeralPorts logs a warning for each runner port inside a range
// the kernel hands out on its own: the host's (rangeFile; a host-mode
// runner shares the host's ports with every outgoing connection) or a new
// network namespace's (in a bridge-mode container Docker's embedded DNS
// listens on a random one of those). Such a runner fails now and then with
// "address already in use", which looks like a broken image. Nothing is
// refused: a port in the range works most of the time, and the operator
// chose it.
func warnEphemeralPorts(log *slog.Logger, rangeFile string, ports map[string]int) {
	ranges := []portrange.Range{portrange.NetnsDefault()}
	if r, err := portrange.Read(rangeFile); err == nil {
		ranges = append(ranges, r)
	} else {
		log.Debug("cannot read the host's local port range", "err", err)
	}
	for name, p := range ports {
		for _, r := range ranges {
			if r.Has(p) {
				log.Warn("a runner port lies in the kernel's ephemeral port range: some tasks' runners will fail to listen with 'address already in use'; pick a port below it",
					"flag", name, "port", p, "range", r.String())
				break
			}
		}
	}
}
