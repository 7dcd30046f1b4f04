package netiso

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/network"

	"github.com/tandem-run/tandem/common/logging"
)

// fakeDocker keeps networks in memory and counts the calls.
type fakeDocker struct {
	mu       sync.Mutex
	nets     map[string]network.Inspect
	inspects int
	creates  int
	slow     time.Duration // each inspect takes this long (a busy daemon)
}

func (f *fakeDocker) NetworkInspect(_ context.Context, id string, _ network.InspectOptions) (network.Inspect, error) {
	time.Sleep(f.slow)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.inspects++
	n, ok := f.nets[id]
	if !ok {
		return network.Inspect{}, cerrdefs.ErrNotFound.WithMessage("network " + id + " not found")
	}
	return n, nil
}

func (f *fakeDocker) NetworkCreate(_ context.Context, name string, o network.CreateOptions) (network.CreateResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.creates++
	if _, ok := f.nets[name]; ok {
		return network.CreateResponse{}, cerrdefs.ErrConflict.WithMessage("exists")
	}
	f.nets[name] = network.Inspect{Name: name, ID: "id-" + name, Driver: o.Driver, Options: o.Options}
	return network.CreateResponse{ID: "id-" + name}, nil
}

func (f *fakeDocker) calls() (int, int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.inspects, f.creates
}

func TestEnsureCreatesOnceAndABurstSharesOneCheck(t *testing.T) {
	d := &fakeDocker{nets: map[string]network.Inspect{}, slow: 20 * time.Millisecond}
	clock := time.Unix(1000, 0)
	var clockMu sync.Mutex
	n := &Network{Name: "iso", Docker: d, Log: logging.Discard(), Now: func() time.Time { clockMu.Lock(); defer clockMu.Unlock(); return clock }}
	var wg sync.WaitGroup
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if name, err := n.Ensure(context.Background()); err != nil || name != "iso" {
				t.Errorf("Ensure: %q %v", name, err)
			}
		}()
	}
	wg.Wait()
	// inspect (missing), create, inspect (check): then every other caller
	// shares that answer.
	if ins, cr := d.calls(); ins != 2 || cr != 1 {
		t.Fatalf("a burst of 64 made %d inspects and %d creates, want 2 and 1", ins, cr)
	}
	// Past the recheck time the network is checked again, and a network
	// removed meanwhile is made again.
	clockMu.Lock()
	clock = clock.Add(DefaultRecheck)
	clockMu.Unlock()
	d.mu.Lock()
	delete(d.nets, "iso")
	d.mu.Unlock()
	if _, err := n.Ensure(context.Background()); err != nil {
		t.Fatal(err)
	}
	if ins, cr := d.calls(); ins != 4 || cr != 2 {
		t.Fatalf("after the recheck time: %d inspects, %d creates; want 4 and 2", ins, cr)
	}
}

func TestEnsureRefusesANetworkThatDoesNotIsolate(t *testing.T) {
	d := &fakeDocker{nets: map[string]network.Inspect{
		"open":  {Name: "open", Driver: "bridge", Options: map[string]string{}},
		"other": {Name: "other", Driver: "macvlan", Options: map[string]string{OptICC: "false"}},
	}}
	for _, name := range []string{"open", "other"} {
		n := &Network{Name: name, Docker: d, Log: logging.Discard()}
		for range 2 { // a refusal is not remembered as a pass
			if _, err := n.Ensure(context.Background()); !errors.Is(err, ErrNotIsolated) {
				t.Fatalf("%s: %v, want ErrNotIsolated", name, err)
			}
		}
	}
	if _, cr := d.calls(); cr != 0 {
		t.Fatal("a network of someone else's was replaced")
	}
}
