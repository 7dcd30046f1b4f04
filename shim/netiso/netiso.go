// Package netiso owns the bridge network that the shim's bridge-mode tasks
// share. Docker's default bridge lets containers open connections to each
// other; on a shared host that lets one tenant's job drive another's runner
// (its API has no authentication, as dstack's has none). Tasks here join a
// bridge network of the shim's own with inter-container communication off
// (the bridge driver's enable_icc=false): a job reaches the internet and
// the host's published services as before, the host reaches each runner
// through its published port as before, and no container on the network
// can open a connection to another one.
//
// The network is created on first use and kept: across shim restarts and
// upgrades, and while no task uses it. A network of that name made by
// someone else without isolation is refused, never used.
package netiso

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/network"
)

// Docker is what the network needs from the Docker client.
type Docker interface {
	NetworkInspect(ctx context.Context, id string, opts network.InspectOptions) (network.Inspect, error)
	NetworkCreate(ctx context.Context, name string, opts network.CreateOptions) (network.CreateResponse, error)
}

// Names of the bridge driver options and our label.
const (
	OptICC = "com.docker.network.bridge.enable_icc"
	// Label marks the networks this package made.
	Label = "run.tandem.shim.network"
	// DefaultName is the network's name unless configured.
	DefaultName = "tandem-isolated"
)

// Network is the isolated network.
type Network struct {
	Name   string
	Docker Docker
	Log    *slog.Logger
	// Recheck is how long a check of the network holds: Ensure within it
	// asks Docker nothing (0: DefaultRecheck). A burst of task starts then
	// costs one inspect, not one each, queued behind every create.
	Recheck time.Duration
	Now     func() time.Time // nil: time.Now

	mu      sync.Mutex // one Ensure at a time: no two creates racing in this shim
	checked time.Time  // when the network was last found isolated; guarded by mu
}

// DefaultRecheck is how long a check of the network holds by default. A
// network removed within it (it cannot be while a task uses it) fails the
// next task's create, and the check after it makes the network again.
const DefaultRecheck = 5 * time.Second

// Ensure returns the network's name once it exists with inter-container
// communication off, creating it when missing. Callers that come while a
// check runs wait for it and share its answer.
func (n *Network) Ensure(ctx context.Context) (string, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	now := time.Now
	if n.Now != nil {
		now = n.Now
	}
	recheck := n.Recheck
	if recheck <= 0 {
		recheck = DefaultRecheck
	}
	if !n.checked.IsZero() && now().Sub(n.checked) < recheck {
		return n.Name, nil
	}
	name, err := n.ensureLocked(ctx)
	if err == nil {
		n.checked = now()
	} else {
		n.checked = time.Time{}
	}
	return name, err
}

// ensureLocked inspects the network and creates it when missing; n.mu is
// held.
func (n *Network) ensureLocked(ctx context.Context) (string, error) {
	for attempt := 0; ; attempt++ {
		got, err := n.Docker.NetworkInspect(ctx, n.Name, network.InspectOptions{})
		switch {
		case err == nil:
			if err := check(n.Name, got); err != nil {
				return "", err
			}
			return n.Name, nil
		case !cerrdefs.IsNotFound(err):
			return "", fmt.Errorf("inspect network %s: %w", n.Name, err)
		case attempt > 0:
			return "", fmt.Errorf("network %s: created, yet Docker does not find it: %w", n.Name, err)
		}
		_, err = n.Docker.NetworkCreate(ctx, n.Name, network.CreateOptions{
			Driver:  "bridge",
			Options: map[string]string{OptICC: "false"},
			Labels:  map[string]string{Label: "isolated"},
		})
		switch {
		case err == nil:
			n.Log.Info("created the isolated task network", "network", n.Name, "inter_container", "off")
		case cerrdefs.IsConflict(err) || cerrdefs.IsAlreadyExists(err):
			// Another shim (or a person) made it meanwhile: check theirs.
		default:
			return "", fmt.Errorf("create network %s: %w", n.Name, err)
		}
	}
}

// ErrNotIsolated is a network of our name that lets containers talk.
var ErrNotIsolated = errors.New("network does not isolate its containers")

func check(name string, got network.Inspect) error {
	switch {
	case got.Name != name:
		// Docker also matches id prefixes; a network named otherwise is
		// not ours.
		return fmt.Errorf("%w: %q resolves to the network %q (id %.12s)", ErrNotIsolated, name, got.Name, got.ID)
	case got.Driver != "bridge":
		return fmt.Errorf("%w: %s uses the %q driver, not bridge; remove it (docker network rm %s) and the shim makes its own", ErrNotIsolated, name, got.Driver, name)
	case got.Options[OptICC] != "false":
		return fmt.Errorf("%w: %s lets its containers reach each other (%s is not false); remove it (docker network rm %s) and the shim makes its own", ErrNotIsolated, name, OptICC, name)
	}
	return nil
}
