package e2e

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/tandem-run/tandem/e2e/testenv"
)

const mpiImage = "tandem-e2e-mpi:bookworm"

// allreduce.py: one all_reduce with the gloo backend, then (STEPS > 1) one
// a second, for the worker-death case. torchrun runs it with --redirects 1
// --tee 1: Debian's torch 1.13 on Python 3.11 fails on the default "0"
// (its Std.from_str finds no zero or combined IntFlag member there), so
// stdout reaches the console through tee, each line prefixed [default0]:.
const allreducePy = `import os, socket, sys, time
import torch
import torch.distributed as dist

t0 = time.time()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.tensor([10.0 * (rank + 1)])
dist.all_reduce(x)
print(f"allreduce rank={rank} world={world} sum={x.item():.0f} host={socket.gethostname()} after={time.time() - t0:.2f}s", flush=True)
for step in range(1, int(os.environ.get("STEPS", "1"))):
    y = torch.ones(1)
    dist.all_reduce(y)
    print(f"step {step} rank={rank} sum={y.item():.0f}", flush=True)
    time.sleep(1)
dist.destroy_process_group()
`

// cluster is two hosts, each with its own dockerd, sshd and shim, and the
// MPI image on both.
type cluster struct {
	hosts []*testenv.Host
	dir   string // the tandem client's HOME (known_hosts, key)
	code  string // uploaded to every node's working dir
}

func newCluster(t *testing.T) *cluster {
	t.Helper()
	bins := testenv.Binaries(t)
	tarball := testenv.MPIRootfs(t)
	c := &cluster{hosts: testenv.Hosts(t), dir: t.TempDir(), code: t.TempDir()}
	var wg sync.WaitGroup
	for _, h := range c.hosts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			h.StartShim(t, bins.Shim, bins.Runner)
			start := time.Now()
			h.ImportImage(t, tarball, mpiImage)
			t.Logf("%s: image imported in %s", h.Name, time.Since(start).Round(100*time.Millisecond))
		}()
	}
	wg.Wait()
	var kh bytes.Buffer
	for _, h := range c.hosts {
		b, _ := os.ReadFile(h.SSHD.KnownHosts)
		kh.Write(b)
	}
	if err := os.WriteFile(filepath.Join(c.dir, "known_hosts"), kh.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(c.code, "allreduce.py"), []byte(allreducePy), 0o644); err != nil {
		t.Fatal(err)
	}
	return c
}

// run makes tandem run --nodes 2 over SSH to both hosts, with the first
// host's client key (TestMultiNode authorizes it on both).
func (c *cluster) run(t *testing.T, script string, extra ...string) (*exec.Cmd, *bytes.Buffer, *bytes.Buffer) {
	t.Helper()
	args := []string{"run", "--nodes", "2", "--identity", c.hosts[0].SSHD.ClientKey, "--known-hosts", filepath.Join(c.dir, "known_hosts"),
		"--image", mpiImage, "--code", c.code, "--no-ssh-config"}
	for _, h := range c.hosts {
		args = append(args, "--ssh", "root@"+h.UplinkIP+":22")
	}
	args = append(args, extra...)
	args = append(args, "--", "bash", "-c", script)
	return tandemIn(t, c.dir, nil, args...)
}

// at runs a tandem command against host h's shim over SSH and returns its
// output; a failure fails the test.
func (c *cluster) at(t *testing.T, h *testenv.Host, args ...string) string {
	t.Helper()
	args = append([]string{args[0], "--ssh", "root@" + h.UplinkIP + ":22", "--identity", c.hosts[0].SSHD.ClientKey, "--known-hosts", filepath.Join(c.dir, "known_hosts")}, args[1:]...)
	cmd, out, errb := tandemIn(t, c.dir, nil, args...)
	if err := cmd.Run(); err != nil {
		t.Fatalf("tandem %s: %v\n%s\n%s", strings.Join(args, " "), err, out, errb)
	}
	return out.String()
}

// tasks lists the task containers left on each host.
func (c *cluster) tasks(t *testing.T) string {
	t.Helper()
	var all []string
	for _, h := range c.hosts {
		out, err := h.Docker(context.Background(), "ps", "-a", "--filter", "label=ai.dstack.shim.is-task=true", "--format", "{{.Names}} {{.Status}}")
		if err != nil {
			t.Fatal(err)
		}
		if s := strings.TrimSpace(out); s != "" {
			all = append(all, h.Name+": "+s)
		}
	}
	return strings.Join(all, "\n")
}

// TestMultiNode (issue 28): two hosts, each a network namespace with its
// own dockerd, sshd and shim, reached by tandem over SSH as a laptop
// reaches two VMs. One job per node as the dstack server submits a
// multi-node task; mpirun and torchrun cross the nodes through the
// runners' embedded SSH servers (the image has no sshd).
func TestMultiNode(t *testing.T) {
	c := newCluster(t)
	// The second host must accept the first host's client key too: one -i
	// for both, as one laptop key for two VMs.
	key, _ := os.ReadFile(c.hosts[0].SSHD.ClientKey + ".pub")
	for _, h := range c.hosts[1:] {
		ak := filepath.Join(filepath.Dir(h.SSHD.ClientKey), "authorized_keys")
		f, err := os.OpenFile(ak, os.O_APPEND|os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = f.Write(key)
		f.Close()
	}
	master, worker := c.hosts[0], c.hosts[1]

	t.Run("mpirun and torchrun across the nodes", func(t *testing.T) {
		script := `set -e
echo "env rank=$DSTACK_NODE_RANK nodes=$DSTACK_NODES_NUM ips=$(echo $DSTACK_NODES_IPS) master=$DSTACK_MASTER_NODE_IP host=$(hostname)"
sed 's/^/hostfile: /' "$DSTACK_MPI_HOSTFILE"
if [ "$DSTACK_NODE_RANK" = 0 ]; then
  ssh "$(echo "$DSTACK_NODES_IPS" | sed -n 2p)" 'echo "ssh to worker: $(hostname)"'
  mpirun --allow-run-as-root -np 2 --map-by node --hostfile "$DSTACK_MPI_HOSTFILE" \
    --mca oob_tcp_if_include eth0 --mca btl_tcp_if_include eth0 hostname | sed 's/^/mpi: /'
fi
python3 -m torch.distributed.run --nnodes 2 --nproc_per_node 1 --node_rank "$DSTACK_NODE_RANK" \
  --master_addr "$DSTACK_MASTER_NODE_IP" --master_port 29500 --redirects 1 --tee 1 allreduce.py
`
		start := time.Now()
		cmd, out, errb := c.run(t, script, "--rm", "--env", "GLOO_SOCKET_IFNAME=eth0")
		err := cmd.Run()
		took := time.Since(start)
		t.Logf("stdout:\n%s\nstderr:\n%s", out, errb)
		if err != nil {
			t.Fatalf("tandem run --nodes 2: %v (took %s)\nmaster shim:\n%s\nworker shim:\n%s", err, took, master.Log("shim.stderr"), worker.Log("shim.stderr"))
		}
		so, se := out.String(), errb.String()
		ips := master.ClusterIP + " " + worker.ClusterIP
		for _, want := range []string{
			"env rank=0 nodes=2 ips=" + ips + " master=" + master.ClusterIP + " host=" + master.Name,
			"hostfile: " + master.ClusterIP + "\nhostfile: " + worker.ClusterIP + "\n",
			"ssh to worker: " + worker.Name,
			"mpi: " + master.Name, "mpi: " + worker.Name,
			"allreduce rank=0 world=2 sum=30 host=" + master.Name,
		} {
			if !strings.Contains(so, want) {
				t.Errorf("master output lacks %q", want)
			}
		}
		for _, want := range []string{
			"[node 1] env rank=1 nodes=2 ips=" + ips + " master=" + master.ClusterIP + " host=" + worker.Name,
			"allreduce rank=1 world=2 sum=30 host=" + worker.Name,
		} {
			if !regexp.MustCompile(`(?m)^\[node 1\] .*` + regexp.QuoteMeta(strings.TrimPrefix(want, "[node 1] "))).MatchString(se) {
				t.Errorf("worker output lacks %q", want)
			}
		}
		if m := regexp.MustCompile(`allreduce rank=0 .* after=(\S+)`).FindStringSubmatch(so); m != nil {
			t.Logf("first all_reduce %s after init_process_group; whole run %s", m[1], took.Round(100*time.Millisecond))
		}
		if left := c.tasks(t); left != "" {
			t.Fatalf("tasks left:\n%s", left)
		}
	})

	t.Run("the run's exit status is the master's; the worker is stopped; both are kept", func(t *testing.T) {
		start := time.Now()
		cmd, out, errb := c.run(t, `if [ "$DSTACK_NODE_RANK" = 0 ]; then sleep 1; echo master-ends; exit 3; fi; echo worker-waits; sleep 600`, "--name", "mn-kept")
		err := cmd.Run()
		if code := exitCodeOf(err); code != 3 {
			t.Fatalf("exit code %d, want the master's 3\n%s\n%s", code, out, errb)
		}
		if took := time.Since(start); took > 90*time.Second {
			t.Fatalf("the run took %s: the worker's sleep held it", took)
		}
		if !strings.Contains(out.String(), "master-ends") || !strings.Contains(errb.String(), "[node 1] worker-waits") {
			t.Fatalf("output:\n%s\n%s", out, errb)
		}
		// Without --rm each node's task is kept, stopped, as docker run
		// keeps its container: ps -a, logs and rm on each host.
		ps := c.at(t, master, "ps", "-a")
		if !regexp.MustCompile(`(?m)^mn-kept-0 .*exited \(3\)`).MatchString(ps) {
			t.Fatalf("master's ps -a lacks the kept mn-kept-0, exited (3):\n%s", ps)
		}
		if ps := c.at(t, worker, "ps", "-a"); !regexp.MustCompile(`(?m)^mn-kept-1 `).MatchString(ps) {
			t.Fatalf("worker's ps -a lacks the kept mn-kept-1:\n%s", ps)
		}
		if logs := c.at(t, master, "logs", "mn-kept-0"); !strings.Contains(logs, "master-ends") {
			t.Fatalf("logs mn-kept-0 of the kept task: %q", logs)
		}
		c.at(t, master, "rm", "mn-kept-0")
		c.at(t, worker, "rm", "mn-kept-1")
		if left := c.tasks(t); left != "" {
			t.Fatalf("tasks left after rm:\n%s", left)
		}
	})

	t.Run("a worker killed mid-job fails the run", func(t *testing.T) {
		// Both nodes all_reduce once a second for 10 minutes; the worker's
		// container is killed after a few steps. The master alone would
		// wait in gloo for its 30-minute timeout.
		cmd, _, _ := c.run(t, `python3 -m torch.distributed.run --nnodes 2 --nproc_per_node 1 --node_rank "$DSTACK_NODE_RANK" \
  --master_addr "$DSTACK_MASTER_NODE_IP" --master_port 29500 --redirects 1 --tee 1 allreduce.py`, "--rm", "--env", "GLOO_SOCKET_IFNAME=eth0", "--env", "STEPS=600")
		out, errBuf, done := startAsync(t, cmd)
		deadline := time.Now().Add(3 * time.Minute)
		step3 := regexp.MustCompile(`(?m)^\[node 1\] .*step 3 rank=1 sum=2`)
		for !step3.MatchString(errBuf.String()) {
			if time.Now().After(deadline) {
				t.Fatalf("no third step:\n%s\n%s", out, errBuf.String())
			}
			time.Sleep(200 * time.Millisecond)
		}
		ids, err := worker.Docker(context.Background(), "ps", "-q", "--filter", "label=ai.dstack.shim.is-task=true")
		if err != nil || strings.TrimSpace(ids) == "" {
			t.Fatalf("worker container: %q %v", ids, err)
		}
		killed := time.Now()
		if _, err := worker.Docker(context.Background(), append([]string{"kill"}, strings.Fields(ids)...)...); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-done:
			t.Logf("the run ended %s after the worker was killed: exit %d", time.Since(killed).Round(100*time.Millisecond), exitCodeOf(err))
			if exitCodeOf(err) == 0 {
				t.Fatalf("the run succeeded without its worker:\n%s\n%s", out, errBuf.String())
			}
		case <-time.After(2 * time.Minute):
			t.Fatalf("the master hung after its worker died:\n%s\n%s", out, errBuf.String())
		}
		msg := regexp.MustCompile(`.*node 1 \(root@` + regexp.QuoteMeta(worker.UplinkIP) + `:22\) (died|ended first).*`).FindString(errBuf.String())
		if msg == "" {
			t.Fatalf("no message about the worker:\n%s", errBuf.String())
		}
		t.Logf("tandem said: %s", msg)
		if left := c.tasks(t); left != "" {
			t.Fatalf("tasks left:\n%s", left)
		}
	})

	t.Run("stopping the run stops both nodes", func(t *testing.T) {
		cmd, _, _ := c.run(t, `echo "ready $DSTACK_NODE_RANK"; trap 'echo "stopped $DSTACK_NODE_RANK"; exit 0' INT TERM; sleep 600 & wait`, "--rm")
		out, errBuf, done := startAsync(t, cmd)
		deadline := time.Now().Add(2 * time.Minute)
		for !strings.Contains(errBuf.String(), "[node 1] ready 1") || !strings.Contains(out.String(), "ready 0") {
			if time.Now().After(deadline) {
				t.Fatalf("nodes not ready:\n%s\n%s", out, errBuf.String())
			}
			time.Sleep(100 * time.Millisecond)
		}
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case err := <-done:
			if code := exitCodeOf(err); code != 130 {
				t.Fatalf("exit %d, want 130\n%s\n%s", code, out, errBuf.String())
			}
		case <-time.After(90 * time.Second):
			t.Fatalf("SIGTERM did not end the run:\n%s\n%s", out, errBuf.String())
		}
		if !strings.Contains(out.String(), "stopped 0") || !regexp.MustCompile(`(?m)^\[node 1\] .*stopped 1`).MatchString(errBuf.String()) {
			t.Fatalf("a node was not stopped gracefully:\n%s\n%s", out, errBuf.String())
		}
		if left := c.tasks(t); left != "" {
			t.Fatalf("tasks left:\n%s", left)
		}
	})
}

// startAsync starts cmd with its output readable while it runs; done gets
// its end. It is killed with the test.
func startAsync(t *testing.T, cmd *exec.Cmd) (out, errb *syncBuffer, done <-chan error) {
	t.Helper()
	out, errb = &syncBuffer{}, &syncBuffer{}
	cmd.Stdout, cmd.Stderr = out, errb
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ch := make(chan error, 1)
	go func() { ch <- cmd.Wait() }()
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	return out, errb, ch
}

// syncBuffer is a bytes.Buffer safe to read while a process writes it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
