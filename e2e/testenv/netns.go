package testenv

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Netns is a network namespace a test made, joined to the host by a veth
// pair on a /30 of its own (10.213.X.0/30: the host end .1, the
// namespace's end .2). The host's dockerd reaches NsIP directly (a
// connected route), so a registry listening there is as far from Docker as
// one across a link, and what the namespace sends back can be shaped.
type Netns struct {
	Name           string // under /run/netns
	HostIf, NsIf   string
	HostIP, NsIP   net.IP
	linkShaped     bool
	totalBytesPerS float64
}

// NetnsPrefix starts the name of every namespace (and veth) a test makes:
// scripts/leftovers.sh looks for them.
const (
	NetnsPrefix = "tandem-ns-"
	vethPrefix  = "tcr"
)

// NewNetns makes a namespace and its veth pair; both go when the test ends
// (deleting the namespace deletes its veth end and so the pair). Call it
// before starting anything inside it: cleanups run last-in first-out, so the
// processes and listeners inside are gone before the namespace is.
func NewNetns(t testing.TB) *Netns {
	t.Helper()
	if os.Geteuid() != 0 {
		if InCI() {
			t.Fatal("CI runs as root")
		}
		t.Skip("needs root for a network namespace")
	}
	id := make([]byte, 3)
	_, _ = rand.Read(id)
	tag := hex.EncodeToString(id)
	n := &Netns{Name: NetnsPrefix + tag, HostIf: vethPrefix + tag + "h", NsIf: vethPrefix + tag + "n"}
	// A /30 no route of the host's covers yet (another test's namespace,
	// in this process or another, holds its own).
	for range 100 {
		x, _ := rand.Int(rand.Reader, big.NewInt(254))
		third := byte(x.Int64() + 1)
		out, err := exec.Command("ip", "-4", "route", "show", fmt.Sprintf("10.213.%d.0/30", third)).Output()
		if err == nil && len(bytes.TrimSpace(out)) == 0 {
			n.HostIP, n.NsIP = net.IPv4(10, 213, third, 1).To4(), net.IPv4(10, 213, third, 2).To4()
			break
		}
	}
	if n.NsIP == nil {
		t.Fatal("no free 10.213.X.0/30 for a test namespace")
	}
	run(t, "ip", "netns", "add", n.Name)
	t.Cleanup(func() {
		if out, err := exec.Command("ip", "netns", "del", n.Name).CombinedOutput(); err != nil {
			t.Errorf("delete netns %s: %v %s", n.Name, err, out)
		}
		// The pair goes with its namespace end; a host end left by a
		// failed move is removed here.
		_ = exec.Command("ip", "link", "del", n.HostIf).Run()
	})
	run(t, "ip", "link", "add", n.HostIf, "type", "veth", "peer", "name", n.NsIf)
	run(t, "ip", "link", "set", n.NsIf, "netns", n.Name)
	run(t, "ip", "addr", "add", n.HostIP.String()+"/30", "dev", n.HostIf)
	run(t, "ip", "link", "set", n.HostIf, "up")
	n.Run(t, "ip", "addr", "add", n.NsIP.String()+"/30", "dev", n.NsIf)
	n.Run(t, "ip", "link", "set", n.NsIf, "up")
	n.Run(t, "ip", "link", "set", "lo", "up")
	return n
}

func run(t testing.TB, name string, args ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if out, err := exec.CommandContext(ctx, name, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v %s", name, strings.Join(args, " "), err, out)
	}
}

// Command is name run inside the namespace (ip netns exec, which execs it:
// the process is name itself, for StartDaemon to own).
func (n *Netns) Command(name string, args ...string) *exec.Cmd {
	return exec.Command("ip", append([]string{"netns", "exec", n.Name, name}, args...)...)
}

// Run runs name inside the namespace and fails the test when it fails.
func (n *Netns) Run(t testing.TB, name string, args ...string) {
	t.Helper()
	run(t, "ip", append([]string{"netns", "exec", n.Name, name}, args...)...)
}

// Listen makes a listening socket inside the namespace from this process:
// a socket belongs to the namespace it was made in, whichever thread uses
// it later. The thread that switched is given back only if it switched
// back; otherwise it stays locked and dies with its goroutine.
func (n *Netns) Listen(network, addr string) (net.Listener, error) {
	type result struct {
		ln  net.Listener
		err error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			done <- result{err: err}
			return
		}
		defer orig.Close()
		target, err := os.Open(filepath.Join("/run/netns", n.Name))
		if err != nil {
			runtime.UnlockOSThread()
			done <- result{err: err}
			return
		}
		defer target.Close()
		if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			done <- result{err: fmt.Errorf("setns %s: %w", n.Name, err)}
			return
		}
		ln, lerr := net.Listen(network, addr)
		if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
			if ln != nil {
				ln.Close()
			}
			done <- result{err: fmt.Errorf("setns back: %w", err)} // the thread stays locked: it exits with us
			return
		}
		runtime.UnlockOSThread()
		done <- result{ln, lerr}
	}()
	r := <-done
	return r.ln, r.err
}

// Shape is what the namespace's link lets through towards the host: each
// TCP connection at most PerConnMbit, all of them together at most
// TotalMbit. Zero or less is no cap of that kind.
type Shape struct {
	PerConnMbit, TotalMbit int
}

// shapeLeaves is how many per-connection classes the link has: the
// (leaves+1)th concurrent connection shares a leaf with the first.
const shapeLeaves = 64

// ShapeEgress caps what leaves the namespace on its veth. This kernel has
// no fq qdisc (whose maxrate paces each flow), so: an HTB root with one
// parent class at the total rate, shapeLeaves leaf classes under it each
// guaranteed total/leaves and allowed up to the per-connection rate (a
// leaf below its own rate would not ask its parent, so the guarantees add
// up to the total and the rest is borrowed from it), and an nftables rule
// in the namespace giving each new connection the next leaf (ct mark from
// numgen, then skb priority = the leaf's classid, which HTB reads before
// any filter). Unmarked traffic (ARP, the handshake's first answer before
// the mark) goes to a default leaf.
func (n *Netns) ShapeEgress(t testing.TB, s Shape) {
	t.Helper()
	const uncapped = 10000 // Mbit: far above what a veth here carries
	total, per := s.TotalMbit, s.PerConnMbit
	if total <= 0 {
		total = uncapped
	}
	if per <= 0 || per > total {
		per = total
	}
	if s.TotalMbit <= 0 && s.PerConnMbit <= 0 {
		return
	}
	n.linkShaped = s.TotalMbit > 0
	n.totalBytesPerS = float64(total) * 1e6 / 8
	guarantee := max(1, total*1000/(shapeLeaves+1)) // kbit
	dev := n.NsIf
	// Bursts of a GSO segment at least: a veth hands HTB 64 KiB packets.
	n.Run(t, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "2")
	n.Run(t, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
		"rate", fmt.Sprintf("%dmbit", total), "ceil", fmt.Sprintf("%dmbit", total), "burst", "256k", "cburst", "256k")
	leaf := func(minor int) {
		n.Run(t, "tc", "class", "add", "dev", dev, "parent", "1:1", "classid", fmt.Sprintf("1:%x", minor), "htb",
			"rate", fmt.Sprintf("%dkbit", guarantee), "ceil", fmt.Sprintf("%dmbit", per),
			"burst", "64k", "cburst", "64k", "quantum", "65536")
	}
	leaf(2)
	var m strings.Builder
	for i := range shapeLeaves {
		minor := 0x10 + i
		leaf(minor)
		if i > 0 {
			m.WriteString(", ")
		}
		fmt.Fprintf(&m, "%d : 1:%x", i+1, minor)
	}
	rules := fmt.Sprintf(`table inet tandemshape {
	chain in {
		type filter hook input priority 0; policy accept;
		ct state new ct mark set numgen inc mod %d offset 1
	}
	chain out {
		type filter hook output priority 0; policy accept;
		ct state established,related meta priority set ct mark map { %s }
	}
}
`, shapeLeaves, m.String())
	path := filepath.Join(t.TempDir(), "shape.nft")
	if err := os.WriteFile(path, []byte(rules), 0o600); err != nil {
		t.Fatal(err)
	}
	n.Run(t, "nft", "-f", path)
}

// LinkBytesPerSecond is the namespace link's total cap (0 when uncapped).
func (n *Netns) LinkBytesPerSecond() float64 {
	if !n.linkShaped {
		return 0
	}
	return n.totalBytesPerS
}
