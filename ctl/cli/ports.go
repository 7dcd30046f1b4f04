package cli

import (
	"fmt"
	"net"
	"strconv"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/ctl"
)

// portsText is ps's PORTS column, as docker ps writes it:
// "0.0.0.0:49153->80/tcp, :::49153->80/tcp"; every string is the shim's,
// so escaped.
func portsText(ports []api.PublishedPort) string {
	parts := make([]string, 0, len(ports))
	for _, p := range ports {
		parts = append(parts, fmt.Sprintf("%s:%d->%d/%s", api.Printable(p.HostIP), p.HostPort, p.ContainerPort, api.Printable(p.Proto())))
	}
	return strings.Join(parts, ", ")
}

// portLines is what tandem port prints, as docker port: every binding as
// "80/tcp -> 0.0.0.0:49153", or, for one port asked, its host addresses.
// want is "" (all), "PORT" (tcp) or "PORT/PROTO".
func portLines(name string, ports []api.PublishedPort, want string) ([]string, error) {
	if want == "" {
		out := make([]string, 0, len(ports))
		for _, p := range ports {
			out = append(out, fmt.Sprintf("%d/%s -> %s", p.ContainerPort, api.Printable(p.Proto()), hostPort(p)))
		}
		return out, nil
	}
	port, proto, _ := strings.Cut(want, "/")
	if proto == "" {
		proto = "tcp"
	}
	n, err := strconv.Atoi(port)
	if err != nil || n < 1 || n > 65535 || (proto != "tcp" && proto != "udp") {
		return nil, fmt.Errorf("%s: want PORT or PORT/tcp or PORT/udp, PORT 1-65535", strconv.Quote(api.Printable(want)))
	}
	var out []string
	for _, p := range ports {
		if p.ContainerPort == n && p.Proto() == proto {
			out = append(out, hostPort(p))
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no public port '%d/%s' published for %s", n, proto, api.Printable(name))
	}
	return out, nil
}

func hostPort(p api.PublishedPort) string {
	return net.JoinHostPort(api.Printable(p.HostIP), strconv.Itoa(p.HostPort))
}

func portCmd() *cli.Command {
	return &cli.Command{Name: "port", Usage: "list a running task's published ports (run -p), or where one of them is on the host, as docker port",
		ArgsUsage:    "TASK [PORT[/PROTO]]",
		Flags:        connFlags(),
		BashComplete: completeTasks,
		Action: func(c *cli.Context) error {
			if c.NArg() < 1 || c.NArg() > 2 {
				return exitError{ctl.ExitFailure, "usage: tandem port TASK [PORT[/PROTO]]"}
			}
			cl, done, err := client(c, nil)
			if err != nil {
				return err
			}
			defer done()
			info, err := cl.Resolve(c.Context, c.Args().First())
			if err != nil {
				return exitError{ctl.ExitFailure, errText(err)}
			}
			var ports []api.PublishedPort
			if info.Tandem != nil {
				ports = info.Tandem.Published
			}
			lines, err := portLines(c.Args().First(), ports, c.Args().Get(1))
			if err != nil {
				return exitError{ctl.ExitFailure, err.Error()}
			}
			for _, l := range lines {
				fmt.Fprintln(c.App.Writer, l)
			}
			return nil
		}}
}
