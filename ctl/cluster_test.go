package ctl

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/netip"
	"strings"
	"testing"

	"golang.org/x/crypto/ssh"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/shimclient"
)

func TestPickNodeIPs(t *testing.T) {
	cases := []struct {
		name           string
		addrs          [][]string
		fixed, targets []string
		want           string // joined, or "error"
	}{
		{"the shared private network, not each host's docker0 or its own uplink",
			[][]string{{"172.17.0.1/16", "192.168.7.2/30", "10.213.1.2/24"}, {"172.17.0.1/16", "192.168.7.6/30", "10.213.1.3/24"}},
			[]string{"", ""}, []string{"192.168.7.2", "192.168.7.6"}, "10.213.1.2 10.213.1.3"},
		{"two shared networks: the one the nodes were dialed at",
			[][]string{{"10.0.0.2/24", "10.1.0.2/24"}, {"10.0.0.3/24", "10.1.0.3/24"}},
			[]string{"", ""}, []string{"10.1.0.2", "10.1.0.3"}, "10.1.0.2 10.1.0.3"},
		{"IPv4 before IPv6",
			[][]string{{"fd00::2/64", "10.0.0.2/24"}, {"fd00::3/64", "10.0.0.3/24"}},
			[]string{"", ""}, []string{"", ""}, "10.0.0.2 10.0.0.3"},
		{"link-local never",
			[][]string{{"fe80::1/64"}, {"fe80::2/64"}},
			[]string{"", ""}, []string{"", ""}, "error"},
		{"no shared subnet",
			[][]string{{"10.0.0.2/24"}, {"10.9.0.3/24"}},
			[]string{"", ""}, []string{"", ""}, "error"},
		{"the same address on both is no network",
			[][]string{{"172.17.0.1/16"}, {"172.17.0.1/16"}},
			[]string{"", ""}, []string{"", ""}, "error"},
		{"--node-ip for every node wins",
			[][]string{nil, nil}, []string{"1.2.3.4", "1.2.3.5"}, []string{"", ""}, "1.2.3.4 1.2.3.5"},
		{"--node-ip for one: the others on its subnet",
			[][]string{nil, {"10.0.0.3/24", "10.1.0.3/24"}, {"10.0.0.4/24", "10.1.0.4/24"}},
			[]string{"10.1.0.2", "", ""}, []string{"", "", ""}, "error"},
		{"--node-ip loopback refused",
			[][]string{nil, nil}, []string{"127.0.0.1", "10.0.0.1"}, []string{"", ""}, "error"},
	}
	for _, c := range cases {
		got, err := pickNodeIPs(c.addrs, c.fixed, c.targets)
		s := strings.Join(got, " ")
		if err != nil {
			s = "error"
		}
		if s != c.want {
			t.Errorf("%s: got %q (%v), want %q", c.name, s, err, c.want)
		}
	}
	// The mixed case works when the master's own list has the subnet.
	got, err := pickNodeIPs([][]string{{"10.1.0.2/24"}, {"10.0.0.3/24", "10.1.0.3/24"}}, []string{"10.1.0.2", ""}, []string{"", ""})
	if err != nil || strings.Join(got, " ") != "10.1.0.2 10.1.0.3" {
		t.Fatalf("mixed: %v %v", got, err)
	}
}

func TestPrefixWriter(t *testing.T) {
	var out bytes.Buffer
	p := &prefixWriter{prefix: "[node 1] ", w: &out}
	_, _ = p.Write([]byte("a\nb"))
	_, _ = p.Write([]byte("c\n\nd"))
	p.flush()
	if want := "[node 1] a\n[node 1] bc\n[node 1] \n[node 1] d\n"; out.String() != want {
		t.Fatalf("got %q want %q", out.String(), want)
	}
	out.Reset()
	_, _ = p.Write(bytes.Repeat([]byte("x"), 3*prefixLineMax+5))
	p.flush()
	lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	if len(lines) != 4 || len(lines[0]) != len("[node 1] ")+prefixLineMax || len(p.buf) != 0 {
		t.Fatalf("endless line: %d lines, first %d bytes", len(lines), len(lines[0]))
	}
}

func TestClusterKey(t *testing.T) {
	k, err := clusterKey("tandem-x")
	if err != nil {
		t.Fatal(err)
	}
	signer, err := ssh.ParsePrivateKey([]byte(k.Private))
	if err != nil {
		t.Fatal(err)
	}
	pub, _, _, _, err := ssh.ParseAuthorizedKey([]byte(k.Public))
	if err != nil || !bytes.Equal(pub.Marshal(), signer.PublicKey().Marshal()) {
		t.Fatalf("public key %q does not match the private one (%v)", k.Public, err)
	}
	if !strings.HasPrefix(k.Private, "-----BEGIN OPENSSH PRIVATE KEY-----") {
		t.Fatalf("not OpenSSH form: %.40q", k.Private)
	}
}

// TestClusterBody: each node's submit body is the dstack server's for job
// n of a multi-node replica: its rank, the node count, the same key and
// cluster_info (every node's address, master first) on every node; a
// terminal size (-t) on the master's only.
func TestClusterBody(t *testing.T) {
	key := &api.SSHKey{Private: "k", Public: "ssh-ed25519 AAAA x"}
	ips := []string{"10.0.0.2", "10.0.0.3"}
	o := RunOptions{Commands: []string{"hostname"}, GPUs: -1, TTY: &api.TermSize{Rows: 30, Cols: 100}}
	gpus := []int{8, 4} // --gpus all: each host's own count
	for rank := range 2 {
		n := &clusterNode{rank: rank, id: fmt.Sprintf("id-%d", rank)}
		b := clusterBody(o, "run-id", "mn", n, ips, gpus, key)
		ci := b.ClusterInfo
		if b.JobSpec.JobNum != rank || b.JobSpec.JobsPerReplica != 2 || b.JobSpec.SSHKey != key || b.Run.ID != "run-id" || b.JobSubmission.ID != n.id ||
			strings.Join(ci.JobIPs, " ") != "10.0.0.2 10.0.0.3" || ci.MasterJobIP != "10.0.0.2" || ci.GPUsPerJob != gpus[rank] || fmt.Sprint(ci.GPUsPerNode) != "[8 4]" {
			t.Fatalf("rank %d: %+v", rank, b)
		}
		// -t sizes the master's terminal only: its output is shown as is.
		if tty := b.Tandem.TTY; (rank == 0) != (tty != nil) || (tty != nil && *tty != *o.TTY) {
			t.Fatalf("rank %d: tandem.tty %+v", rank, tty)
		}
	}
}

func TestLastLine(t *testing.T) {
	for in, want := range map[string]string{"": "", "a\nb\n": ": b", "x\x1b[31m": ": x\\x1b[31m"} {
		if got := lastLine(in); got != want {
			t.Errorf("lastLine(%q) = %q, want %q", in, got, want)
		}
	}
	if got := lastLine(strings.Repeat("y", 500)); len(got) != 202 {
		t.Errorf("long line: %d bytes", len(got))
	}
}

// FuzzPickNodeIPs: the shims' address lists are network input; whatever
// they hold, picking never panics and a pick is one address per node, all
// different, each from that node's own list.
func FuzzPickNodeIPs(f *testing.F) {
	f.Add("10.0.0.2/24 172.17.0.1/16", "10.0.0.3/24 172.17.0.1/16", "", "10.0.0.3")
	f.Add("fd00::2/64", "fd00::3/64 junk", "::1", "")
	f.Fuzz(func(t *testing.T, a, b, fixedA, targetB string) {
		addrs := [][]string{strings.Fields(a), strings.Fields(b)}
		got, err := pickNodeIPs(addrs, []string{fixedA, ""}, []string{"", targetB})
		if err != nil {
			return
		}
		if len(got) != 2 || got[0] == got[1] {
			t.Fatalf("pick %v from %v", got, addrs)
		}
		for i, ip := range got {
			if i == 0 && fixedA != "" {
				continue
			}
			found := false
			for _, cidr := range addrs[i] {
				if p, err := netip.ParsePrefix(cidr); err == nil && p.Addr().String() == ip {
					found = true
				}
			}
			if !found {
				t.Fatalf("node %d: %s is not in %v", i, ip, addrs[i])
			}
		}
	})
}

// TestClusterFacts: with Tandem's shims the addresses and (--gpus all) the
// GPU counts come from each host; a dstack shim (404) is reached at the
// address it was dialed at.
func TestClusterFacts(t *testing.T) {
	host := func(body string) *shimclient.Client {
		return testShim(t, func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/api/instance/host" || body == "" {
				http.NotFound(w, r)
				return
			}
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(body))
		})
	}
	cs := []*clusterNode{
		{rank: 0, c: onShim(host(`{"hostname":"a","addresses":["172.17.0.1/16","10.0.0.2/24"],"gpu_count":8}`), nil)},
		{rank: 1, c: onShim(host(`{"hostname":"b","addresses":["172.17.0.1/16","10.0.0.3/24"],"gpu_count":4}`), nil)},
	}
	ips, gpus, err := clusterFacts(context.Background(), cs, -1)
	if err != nil || fmt.Sprint(ips, gpus) != "[10.0.0.2 10.0.0.3] [8 4]" {
		t.Fatalf("--gpus all: %v %v %v", ips, gpus, err)
	}
	if _, gpus, _ := clusterFacts(context.Background(), cs, 2); fmt.Sprint(gpus) != "[2 2]" {
		t.Fatalf("--gpus 2: %v", gpus)
	}
	dstack := []*clusterNode{{rank: 0, c: onShim(host(""), nil), Node: Node{Target: "192.168.1.5"}}, {rank: 1, c: onShim(host(""), nil), Node: Node{Target: "192.168.1.6"}}}
	if ips, _, err := clusterFacts(context.Background(), dstack, 0); err != nil || fmt.Sprint(ips) != "[192.168.1.5 192.168.1.6]" {
		t.Fatalf("dstack shims: %v %v", ips, err)
	}
	dstack[1].Target = ""
	if _, _, err := clusterFacts(context.Background(), dstack, 0); err == nil || HintOf(err) != HintNodeIP {
		t.Fatalf("dstack shim dialed by name: %v", err)
	}
}
