package cli

import (
	"strings"
	"testing"

	"github.com/tandem-run/tandem/api"
)

// TestParsePublish: docker run -p's spellings, and a clear refusal for
// the rest.
func TestParsePublish(t *testing.T) {
	for in, want := range map[string]api.PublishedPort{
		"80":                {ContainerPort: 80},
		"8080:80":           {HostPort: 8080, ContainerPort: 80},
		"127.0.0.1:8080:80": {HostIP: "127.0.0.1", HostPort: 8080, ContainerPort: 80},
		"127.0.0.1::80":     {HostIP: "127.0.0.1", ContainerPort: 80},
		"5353:53/udp":       {HostPort: 5353, ContainerPort: 53, Protocol: "udp"},
		"[::1]:8080:80/tcp": {HostIP: "::1", HostPort: 8080, ContainerPort: 80, Protocol: "tcp"},
		":80":               {ContainerPort: 80},
	} {
		got, err := parsePublish(in)
		if err != nil || got != want {
			t.Errorf("%q: %+v %v, want %+v", in, got, err, want)
		}
	}
	for in, why := range map[string]string{
		"":                 `the container port "" is not a port`,
		"0":                `the container port "0" is not a port`,
		"70000":            `the container port "70000" is not a port`,
		"8000-8010:80":     `the host port "8000-8010" is a range: give each port with its own -p`,
		"80/sctp":          "the protocol must be tcp or udp",
		"host:8080:80":     `"host" is not an IP address`,
		"1:2:3:4":          "too many colons",
		"[::1]8080:80":     "an IPv6 address in brackets",
		"8080:+80":         `the container port "+80" is not a port`,
		"fe80::1%eth0::80": "too many colons",
	} {
		_, err := parsePublish(in)
		if err == nil || !strings.Contains(err.Error(), why) || !strings.Contains(err.Error(), "want [HOST_IP:][HOST_PORT:]CONTAINER_PORT") {
			t.Errorf("%q: %v, want an error saying %q", in, err, why)
		}
	}
}

// FuzzParsePublish: any -p value is a port set in range or an error
// that names what to type, never a panic.
func FuzzParsePublish(f *testing.F) {
	for _, s := range []string{"80", "8080:80", "127.0.0.1::80/udp", "[::1]:1:2", "[", "::::", "1-2:3", "/tcp"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		p, err := parsePublish(s)
		if err != nil {
			if !strings.Contains(err.Error(), "want [HOST_IP:][HOST_PORT:]CONTAINER_PORT") {
				t.Fatalf("%q: %v", s, err)
			}
			return
		}
		if p.ContainerPort < 1 || p.ContainerPort > 65535 || p.HostPort < 0 || p.HostPort > 65535 ||
			(p.Protocol != "" && p.Protocol != "tcp" && p.Protocol != "udp") {
			t.Fatalf("%q: took %+v", s, p)
		}
	})
}
