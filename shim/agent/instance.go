package agent

import (
	"context"
	"os"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/shim/gpu"
	"github.com/tandem-run/tandem/shim/hostinfo"
	"github.com/tandem-run/tandem/shim/task"
)

// hostInstance answers the API's instance routes (server.Instance).
type hostInstance struct {
	gpus   []gpu.GPU
	health instanceHealth
}

func (h hostInstance) Info() api.InstanceInfoResponse {
	if len(h.gpus) == 0 {
		return api.InstanceInfoResponse{}
	}
	return api.InstanceInfoResponse{GPUVendor: h.gpus[0].Vendor, GPUDriverVersion: h.gpus[0].DriverVersion}
}

func (h hostInstance) Host() (api.InstanceHostResponse, error) {
	name, _ := os.Hostname()
	addrs, err := hostinfo.Addresses()
	return api.InstanceHostResponse{Hostname: name, Addresses: addrs, GPUCount: len(h.gpus)}, err
}

func (h hostInstance) Health(ctx context.Context) *api.DCGMHealth { return h.health.check(ctx) }

// nvidiaMetrics serves per-task GPU metrics (server.GPUMetrics): a
// dcgm-exporter on the host wins (dstack's behaviour), NVML otherwise.
type nvidiaMetrics struct {
	exporter *gpu.Exporter // nil: no exporter port configured
	nvml     *gpu.Metrics
}

func (m nvidiaMetrics) TaskMetrics(ctx context.Context, ids []string) (string, bool, error) {
	if m.exporter != nil {
		if text, err := m.exporter.Fetch(ctx); err == nil {
			return gpu.FilterExposition(text, ids), true, nil
		}
	}
	return m.nvml.Text(ids), true, nil
}

// recovered holds task calls until recovery after a start is done
// (server.Readiness): up to 10 s, then task.ErrNotReady (503; the server
// retries).
type recovered struct{ done <-chan struct{} }

func (r recovered) Ready(ctx context.Context) error {
	select {
	case <-r.done: // every task call after start-up: no timer
		return nil
	default:
	}
	t := time.NewTimer(10 * time.Second)
	defer t.Stop()
	select {
	case <-r.done:
		return nil
	case <-t.C:
		return task.ErrNotReady
	case <-ctx.Done():
		return ctx.Err()
	}
}
