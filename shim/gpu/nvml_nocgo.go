//go:build !cgo

package gpu

import (
	"context"
	"fmt"
	"time"

	"github.com/tandem-run/tandem/api"
)

// NVML is unavailable in a build without cgo: go-nvml needs it.
type NVML struct{}

// NewNVML returns a source that explains why NVIDIA GPUs are not seen.
func NewNVML() *NVML { return &NVML{} }

// Vendor implements Source.
func (*NVML) Vendor() api.GPUVendor { return api.GPUVendorNVIDIA }

// Discover implements Source.
func (*NVML) Discover(context.Context) ([]GPU, error) {
	return nil, fmt.Errorf("%w: this dstack-shim was built without cgo, so NVML cannot be loaded", ErrNotPresent)
}

// Present sees no GPUs without NVML.
func (n *NVML) Present() ([]string, error) {
	_, err := n.Discover(context.Background())
	return nil, err
}

// Health reports nothing without NVML.
func (*NVML) Health(map[string][]uint64) *api.DCGMHealth { return nil }

// WatchXIDs watches nothing without NVML.
func (*NVML) WatchXIDs(context.Context) func() map[string][]uint64 {
	return func() map[string][]uint64 { return nil }
}

// Metrics has nothing to report without NVML.
type Metrics struct {
	NVML     *NVML
	Interval time.Duration
	Now      func() time.Time
}

// Text returns no samples.
func (*Metrics) Text([]string) string { return "" }
