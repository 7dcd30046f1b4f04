package ctl

// A node of a multi-node run: where it is reached and what the run holds
// of it.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/runnerclient"
)

// Node is one host of a multi-node run: its shim, reached with the run's
// Config but for Shim and Dial.
type Node struct {
	Shim string // shim address (as seen from the far end with Dial)
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
	// Label names the node in messages (its SSH target or shim address).
	Label string
	// IP is the address the other nodes reach this one at; "" picks it from
	// the addresses the shims report (a subnet all nodes share).
	IP string
	// Target is the address the node was dialed at, preferred when it lies
	// on the shared network ("" when not an IP).
	Target string
}

// clusterNode is a node during the run.
type clusterNode struct {
	Node
	rank   int
	c      *Client // set by connect
	id     string
	name   string
	info   api.TaskInfoResponse
	runner *runnerclient.Client
}

func (n *clusterNode) String() string { return fmt.Sprintf("node %d (%s)", n.rank, n.Label) }

// onEach runs f for every node at once and joins the errors.
func onEach(nodes []*clusterNode, f func(n *clusterNode) error) error {
	errs := make([]error, len(nodes))
	var wg sync.WaitGroup
	for i, n := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := f(n); err != nil {
				errs[i] = fmt.Errorf("%s: %w", n, err)
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}
