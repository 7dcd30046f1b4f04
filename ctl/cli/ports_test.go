package cli

import (
	"reflect"
	"strings"
	"testing"

	"github.com/tandem-run/tandem/api"
)

func TestPortsText(t *testing.T) {
	ports := []api.PublishedPort{
		{HostIP: "0.0.0.0", HostPort: 49153, ContainerPort: 80, Protocol: "tcp"},
		{HostIP: "::", HostPort: 49153, ContainerPort: 80, Protocol: "tcp"},
		{HostIP: "127.0.0.1", HostPort: 5353, ContainerPort: 53, Protocol: "udp"},
		{HostIP: "1.2.3.4\x1b[2J", HostPort: 1, ContainerPort: 2},
	}
	got := portsText(ports)
	want := `0.0.0.0:49153->80/tcp, :::49153->80/tcp, 127.0.0.1:5353->53/udp, 1.2.3.4\x1b[2J:1->2/tcp`
	if got != want {
		t.Fatalf("portsText: %q, want %q", got, want)
	}
	if portsText(nil) != "" {
		t.Fatal("no ports: want an empty column")
	}
	all, err := portLines("web", ports[:3], "")
	if wantAll := []string{"80/tcp -> 0.0.0.0:49153", "80/tcp -> [::]:49153", "53/udp -> 127.0.0.1:5353"}; err != nil || !reflect.DeepEqual(all, wantAll) {
		t.Fatalf("portLines all: %q %v, want %q", all, err, wantAll)
	}
	one, err := portLines("web", ports[:3], "80")
	if wantOne := []string{"0.0.0.0:49153", "[::]:49153"}; err != nil || !reflect.DeepEqual(one, wantOne) {
		t.Fatalf("portLines 80: %q %v", one, err)
	}
	if one, err := portLines("web", ports[:3], "53/udp"); err != nil || !reflect.DeepEqual(one, []string{"127.0.0.1:5353"}) {
		t.Fatalf("portLines 53/udp: %q %v", one, err)
	}
	for in, want := range map[string]string{
		"53":      "no public port '53/tcp' published for web",
		"0":       `"0": want PORT or PORT/tcp or PORT/udp`,
		"80/sctp": `"80/sctp": want PORT`,
		"x\x1b":   `"x\\x1b": want PORT`,
	} {
		if _, err := portLines("web", ports[:3], in); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("portLines %q: %v, want %q", in, err, want)
		}
	}
}
