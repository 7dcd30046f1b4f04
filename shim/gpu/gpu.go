// Package gpu owns the host's GPUs as the shim sees them: discovery per
// vendor (NVML for NVIDIA, sysfs for AMD), which task holds which GPU, the
// container wiring each vendor needs, and NVML health and metrics.
package gpu

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"

	"github.com/tandem-run/tandem/api"
)

// GPU is one detected accelerator.
type GPU struct {
	Vendor        api.GPUVendor
	Name          string
	MemoryMiB     int64
	ID            string // resource id: NVIDIA UUID, AMD render node path
	Index         int
	DriverVersion string
	PCIBusID      string
	MIGEnabled    bool
	NUMANode      int // -1 when unknown
}

// Source discovers the GPUs of one vendor.
type Source interface {
	Vendor() api.GPUVendor
	// Discover returns the vendor's GPUs; ErrNotPresent when the vendor's
	// hardware or library is absent (not a failure).
	Discover(ctx context.Context) ([]GPU, error)
}

// ErrNotPresent means a vendor has no GPUs (or no driver library) here.
var ErrNotPresent = errors.New("not present")

// ErrMixedVendors means discrete GPUs of several vendors were found.
var ErrMixedVendors = errors.New("GPUs of more than one vendor")

// Discover asks every source (never stopping at the first match) and
// returns the GPUs of the one vendor present. Discrete GPUs of two vendors
// are an error: the shim cannot wire both into one task model. Reasons for
// an empty result are logged once, here.
func Discover(ctx context.Context, log *slog.Logger, sources ...Source) ([]GPU, error) {
	found := map[api.GPUVendor][]GPU{}
	var vendors []string
	for _, s := range sources {
		gpus, err := s.Discover(ctx)
		switch {
		case errors.Is(err, ErrNotPresent):
			log.Info("no GPUs from vendor", "vendor", s.Vendor(), "reason", err)
			continue
		case err != nil:
			log.Error("GPU discovery failed", "vendor", s.Vendor(), "err", err)
			continue
		case len(gpus) == 0:
			continue
		}
		found[s.Vendor()] = gpus
		vendors = append(vendors, string(s.Vendor()))
	}
	switch len(found) {
	case 0:
		log.Info("this host has no GPUs the shim can use")
		return []GPU{}, nil
	case 1:
		for v, gpus := range found {
			log.Info("GPUs discovered", "vendor", v, "count", len(gpus), "name", gpus[0].Name, "driver", gpus[0].DriverVersion)
			return gpus, nil
		}
	}
	return nil, fmt.Errorf("%w: %s; the shim runs one vendor per host", ErrMixedVendors, strings.Join(vendors, " and "))
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
