package ctl

import (
	"fmt"
	"net/netip"
	"strings"
)

// pickNodeIPs chooses the address each node of a multi-node run is reached
// at by the others: one subnet in which every node has an address, all of
// them different (the Docker bridge each host has at 172.17.0.1 is thus
// never chosen). addrs[i] are node i's interface addresses in CIDR form, as
// its shim reports them; fixed[i], when set, is given by the user and
// wins. targets[i] is the address node i was dialed at ("" if not an IP):
// a subnet holding those is preferred, then IPv4, then the master's
// interface order.
func pickNodeIPs(addrs [][]string, fixed, targets []string) ([]string, error) {
	n := len(addrs)
	out := make([]string, n)
	missing := false
	for i := range out {
		if fixed[i] != "" {
			ip, err := netip.ParseAddr(fixed[i])
			if err != nil || ip.IsLoopback() || ip.IsUnspecified() {
				return nil, fmt.Errorf("node %d: address %q is not a usable IP address", i, fixed[i])
			}
			out[i] = ip.String()
		} else {
			missing = true
		}
	}
	if !missing {
		return out, nil
	}
	nets := make([][]netip.Prefix, n)
	for i, list := range addrs {
		for _, a := range list {
			p, err := netip.ParsePrefix(a)
			if err != nil || p.Addr().IsLoopback() || p.Addr().IsLinkLocalUnicast() || p.Addr().IsMulticast() {
				continue
			}
			nets[i] = append(nets[i], p)
		}
	}
	type candidate struct {
		ips   []string
		score int
	}
	var best *candidate
	for _, p0 := range nets[0] {
		subnet := p0.Masked()
		c := candidate{ips: make([]string, n)}
		seen := map[netip.Addr]bool{}
		ok := true
		for i := range n {
			var pick netip.Addr
			for _, p := range nets[i] {
				if p.Masked() == subnet && !seen[p.Addr()] {
					pick = p.Addr()
					if targets[i] == pick.String() {
						break
					}
				}
			}
			if !pick.IsValid() {
				ok = false
				break
			}
			seen[pick] = true
			c.ips[i] = pick.String()
			if targets[i] == c.ips[i] {
				c.score += 2
			}
		}
		if !ok {
			continue
		}
		if subnet.Addr().Is4() {
			c.score++
		}
		// A node given --node-ip must be on the chosen subnet too.
		for i := range n {
			if fixed[i] != "" {
				ip := netip.MustParseAddr(out[i])
				if !subnet.Contains(ip) {
					ok = false
				}
			}
		}
		if ok && (best == nil || c.score > best.score) {
			best = &c
		}
	}
	if best == nil {
		var b strings.Builder
		for i, list := range addrs {
			fmt.Fprintf(&b, "\n  node %d: %s", i, strings.Join(list, " "))
		}
		return nil, withHint(HintNodeIP, fmt.Errorf("the nodes share no network (a subnet where each has its own address); their addresses, in node order:%s", b.String()))
	}
	for i := range out {
		if out[i] == "" {
			out[i] = best.ips[i]
		}
	}
	return out, nil
}
