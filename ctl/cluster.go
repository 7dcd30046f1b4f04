package ctl

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"errors"
	"fmt"
	"strings"

	"golang.org/x/crypto/ssh"

	"github.com/tandem-run/tandem/api"
)

// clusterKey is the job's SSH key pair, as the dstack server makes one per
// multi-node replica: the private key in OpenSSH form, the public one as an
// authorized_keys line.
func clusterKey(comment string) (*api.SSHKey, error) {
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, err
	}
	block, err := ssh.MarshalPrivateKey(priv, comment)
	if err != nil {
		return nil, err
	}
	spub, err := ssh.NewPublicKey(pub)
	if err != nil {
		return nil, err
	}
	return &api.SSHKey{Private: string(pem.EncodeToMemory(block)), Public: strings.TrimSpace(string(ssh.MarshalAuthorizedKey(spub))) + " " + comment}, nil
}

// Cluster is a multi-node run: one job on every node, as the dstack server
// runs a multi-node task. Its steps are Execute's: connect, plan, bring up
// the tasks, start the jobs, follow, remove. Stop ends it early (every
// node), as Run's does.
type Cluster struct {
	*stopper
	c     *Client // the run's config; each node has its own client of it
	o     RunOptions
	runID string
	name  string
	cs    []*clusterNode
	// plan: the nodes' addresses (master first), GPUs per node, job key.
	ips  []string
	gpus []int
	key  *api.SSHKey
}

// NewCluster checks o for a multi-node run on nodes, each reached with
// c's config (its Shim and Dial the node's), and returns the run, not
// started yet.
func NewCluster(c *Client, o RunOptions, nodes []Node) (*Cluster, error) {
	switch {
	case len(nodes) < 2:
		return nil, errors.New("a multi-node run needs at least two nodes")
	case checkCommand(o) != nil:
		return nil, checkCommand(o)
	case o.Detach:
		return nil, errors.New("a detached run has one node; a multi-node run is followed to its end")
	case o.Network != "" && o.Network != "host":
		return nil, errors.New("a multi-node run uses host networking (the nodes reach each other at the hosts' addresses), as dstack's does")
	}
	o.Network = "host"
	if err := checkRun(o, c.say); err != nil {
		return nil, err
	}
	run := *c
	if p := c.say; p != nil { // several nodes report at once: no redrawing
		run.say = func(e Event) { e.Concurrent = true; p(e) }
	}
	cl := &Cluster{stopper: newStopper(), c: &run, o: o, runID: newID()}
	cl.name = runName(o.Name, cl.runID)
	if err := checkJobBody(jobBody(o, cl.runID, cl.name)); err != nil { // each node's adds only its addresses and key
		return nil, err
	}
	for i, n := range nodes {
		if n.Label == "" {
			n.Label = n.Shim
		}
		cl.cs = append(cl.cs, &clusterNode{Node: n, rank: i, id: newID(), name: fmt.Sprintf("%s-%d", cl.name, i)})
	}
	return cl, nil
}

// Execute runs one job on every node: host networking, the same commands
// everywhere, node 0 the master. Every node gets cluster_info (the nodes'
// addresses, master first), its rank and the job's SSH key pair, so mpirun
// and torchrun reach the other nodes through their runners' SSH servers.
// The run ends with the master (the others are stopped then: dstack's
// master-done); a worker that fails or dies first fails the run and stops
// the rest. At the end every node's task is stopped and kept with Keep
// (one per host, NAME-0 the master's), as a single-node run's is, until
// tandem rm or prune; without Keep, or for a node whose task never got a
// container, it is removed.
func (c *Cluster) Execute(ctx context.Context) (res Result, err error) {
	ctx, cancel := c.begin(ctx)
	defer cancel(nil)
	res = Result{TaskID: c.runID, Name: c.name}
	if err := c.connect(ctx); err != nil {
		return Result{Interrupted: interrupted(ctx)}, err
	}
	if err := c.plan(ctx); err != nil {
		return res, err
	}
	// From the first submit on, every task is ended at the end.
	killNow := false
	defer func() {
		if kept := c.endAll(context.WithoutCancel(ctx), killNow || res.Interrupted); len(kept) > 0 {
			res.Kept, res.KeptNames = true, kept
		}
	}()
	fail := func(err error) (Result, error) {
		return failEarly(ctx, c.c.say, c.o.Keep, &res, err, "the run's tasks")
	}
	if err := c.bringUp(ctx); err != nil {
		return fail(err)
	}
	if err := c.startJobs(ctx); err != nil {
		return fail(err)
	}
	c.started()
	if interrupted(ctx) {
		return fail(ErrInterrupted)
	}
	if feedsTerminal(c.o) {
		go feedStdin(ctx, c.cs[0].runner, c.o, c.c.say) // the master's terminal
	}
	if c.o.Started != nil {
		c.o.Started(c.cs[0].info)
	}
	res, killNow = followCluster(ctx, c.c, c.cs, c.stops, c.o, res)
	return res, nil
}

// connect checks that every node's shim answers.
func (c *Cluster) connect(ctx context.Context) error {
	return onEach(c.cs, func(n *clusterNode) error {
		nc, err := c.c.at(n.Shim, n.Dial)
		if err != nil {
			return err
		}
		n.c = nc
		hc, err := nc.hello(ctx)
		if err != nil {
			return err
		}
		c.c.say.status("%s: shim %s (%s)", n, n.Shim, hc.Version)
		return nil
	})
}

// plan picks the nodes' addresses and GPU counts and makes the job's key.
func (c *Cluster) plan(ctx context.Context) error {
	ips, gpus, err := clusterFacts(ctx, c.cs, c.o.GPUs)
	if err != nil {
		return err
	}
	c.c.say.status("nodes: %s (master %s)", strings.Join(ips, " "), ips[0])
	key, err := clusterKey("tandem-" + c.runID[:8])
	if err != nil {
		return fmt.Errorf("job key: %w", err)
	}
	c.ips, c.gpus, c.key = ips, gpus, key
	return nil
}

// bringUp submits every node's task and waits until its runner answers.
func (c *Cluster) bringUp(ctx context.Context) error {
	return onEach(c.cs, func(n *clusterNode) error {
		first, err := n.c.submitTask(ctx, taskConfig(c.o, n.id, n.name))
		if err != nil {
			return err
		}
		info, err := n.c.waitTask(ctx, n.id, c.o.Image, first, nil)
		if err != nil {
			return err
		}
		if info.Status == api.TaskTerminated {
			return n.c.taskEnded(ctx, info, c.o.Network)
		}
		n.info = info
		n.runner, err = n.c.readyRunner(ctx, info, c.o.Network)
		return err
	})
}

// startJobs gives every node its job before any starts (a master's
// launcher finds the others' SSH servers taking the job key), then starts
// the workers and last the master.
func (c *Cluster) startJobs(ctx context.Context) error {
	if err := onEach(c.cs, func(n *clusterNode) error {
		b := clusterBody(c.o, c.runID, c.name, n, c.ips, c.gpus, c.key)
		if err := n.c.imageJob(ctx, n.id, c.o, &b); err != nil {
			return err
		}
		return prepareJob(ctx, n.runner, c.o, b)
	}); err != nil {
		return err
	}
	if err := onEach(c.cs[1:], func(n *clusterNode) error { return startJob(ctx, n.runner, nil) }); err != nil {
		return err
	}
	if err := startJob(ctx, c.cs[0].runner, c.c.say); err != nil {
		return fmt.Errorf("%s: %w", c.cs[0], err)
	}
	return nil
}

// endAll stops every node's task (with a 5 s grace, none when now) and
// keeps it with Keep when it got a container, else removes it, as Run.End
// ends one task; it returns the names of the tasks kept. A task that
// cannot be ended is an EventTaskLeft.
func (c *Cluster) endAll(ctx context.Context, now bool) []string {
	kept := make([]bool, len(c.cs))
	_ = onEach(c.cs, func(n *clusterNode) error {
		if n.c == nil {
			return nil
		}
		var err error
		if keepsTask(c.o.Keep, n.info) {
			err = n.c.terminate(ctx, n.id, stopGrace(now))
			kept[n.rank] = err == nil
		} else {
			err = n.c.cleanup(ctx, n.id, stopGrace(now), false)
		}
		if err != nil {
			c.c.say.emit(Event{Kind: EventTaskLeft, Node: n.String(), Task: ShortID(n.id), Name: n.name, Shim: n.Shim, Err: err})
		}
		return nil
	})
	var names []string
	for i, k := range kept {
		if k {
			names = append(names, c.cs[i].name)
		}
	}
	return names
}

// clusterFacts finds each node's address on the network the nodes share
// and its GPU count for the job: --gpus, or with --gpus all the host's
// count as its shim reports it.
func clusterFacts(ctx context.Context, cs []*clusterNode, gpus int) (ips []string, perNode []int, err error) {
	addrs := make([][]string, len(cs))
	fixed := make([]string, len(cs))
	targets := make([]string, len(cs))
	perNode = make([]int, len(cs))
	for i, n := range cs {
		fixed[i], targets[i], perNode[i] = n.IP, n.Target, max(gpus, 0)
	}
	err = onEach(cs, func(n *clusterNode) error {
		h, err := n.c.shim.InstanceHost(ctx)
		switch {
		case errors.Is(err, api.ErrNotFound):
			// dstack's own shim: the address it was dialed at is all we know.
			if n.IP == "" && n.Target == "" {
				return withHint(HintNodeIP, errors.New("its shim does not list the host's addresses"))
			}
			if n.IP == "" {
				fixed[n.rank] = n.Target
			}
			return nil
		case err != nil:
			return fmt.Errorf("host facts: %w", err)
		}
		addrs[n.rank] = h.Addresses
		if gpus < 0 {
			perNode[n.rank] = h.GPUCount
		}
		return nil
	})
	if err != nil {
		return nil, nil, err
	}
	ips, err = pickNodeIPs(addrs, fixed, targets)
	return ips, perNode, err
}

// clusterBody is node n's submit body, as the dstack server's for job n of
// a multi-node replica.
func clusterBody(o RunOptions, runID, name string, n *clusterNode, ips []string, gpus []int, key *api.SSHKey) api.SubmitBody {
	b := jobBody(o, runID, name)
	b.JobSubmission.ID = n.id
	b.JobSpec.JobNum = n.rank
	b.JobSpec.JobsPerReplica = len(ips)
	b.JobSpec.SSHKey = key
	b.ClusterInfo = api.ClusterInfo{JobIPs: ips, MasterJobIP: ips[0], GPUsPerJob: gpus[n.rank], GPUsPerNode: gpus}
	if n.rank != 0 {
		b.Tandem.TTY = nil // the workers' output is shown in prefixed lines: no terminal's size
	}
	return b
}
