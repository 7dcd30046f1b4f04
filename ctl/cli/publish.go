package cli

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	"github.com/tandem-run/tandem/api"
)

// parsePublish reads one -p as docker run does:
// [HOST_IP:][HOST_PORT:]CONTAINER_PORT[/tcp|udp], an IPv6 HOST_IP in
// brackets. An empty HOST_PORT (IP::PORT) lets Docker pick one. A range
// (8000-8010) is refused: give each port.
func parsePublish(spec string) (api.PublishedPort, error) {
	bad := func(why string) (api.PublishedPort, error) {
		return api.PublishedPort{}, fmt.Errorf("--publish %s: %s; want [HOST_IP:][HOST_PORT:]CONTAINER_PORT[/tcp|udp], e.g. -p 8080:80 or -p 127.0.0.1:8080:80", strconv.Quote(spec), why)
	}
	var p api.PublishedPort
	rest := spec
	if i := strings.LastIndexByte(rest, '/'); i >= 0 {
		p.Protocol, rest = rest[i+1:], rest[:i]
		if p.Protocol != "tcp" && p.Protocol != "udp" {
			return bad("the protocol must be tcp or udp")
		}
	}
	var host, hostPort, cport string
	if strings.HasPrefix(rest, "[") { // [v6]:HOST_PORT:CONTAINER_PORT
		end := strings.Index(rest, "]:")
		if end < 0 {
			return bad("an IPv6 address in brackets is followed by :HOST_PORT:CONTAINER_PORT")
		}
		host, rest = rest[1:end], rest[end+2:]
		var ok bool
		if hostPort, cport, ok = strings.Cut(rest, ":"); !ok {
			return bad("an address is followed by :HOST_PORT:CONTAINER_PORT")
		}
	} else {
		parts := strings.Split(rest, ":")
		switch len(parts) {
		case 1:
			cport = parts[0]
		case 2:
			hostPort, cport = parts[0], parts[1]
		case 3:
			host, hostPort, cport = parts[0], parts[1], parts[2]
		default:
			return bad("too many colons (an IPv6 address goes in brackets)")
		}
	}
	if host != "" {
		a, err := netip.ParseAddr(host)
		if err != nil || a.Zone() != "" {
			return bad(fmt.Sprintf("%s is not an IP address", strconv.Quote(host)))
		}
		p.HostIP = a.String()
	}
	var err error
	if p.ContainerPort, err = portNumber(cport, false); err != nil {
		return bad("the container port " + err.Error())
	}
	if p.HostPort, err = portNumber(hostPort, true); err != nil {
		return bad("the host port " + err.Error())
	}
	return p, nil
}

// portNumber reads a port, 1-65535; empty is 0 where any is allowed.
func portNumber(s string, anyOK bool) (int, error) {
	if s == "" && anyOK {
		return 0, nil
	}
	if strings.Contains(s, "-") {
		return 0, fmt.Errorf("%s is a range: give each port with its own -p", strconv.Quote(s))
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 || n > 65535 || strings.HasPrefix(s, "+") {
		return 0, fmt.Errorf("%s is not a port (1-65535)", strconv.Quote(s))
	}
	return n, nil
}
