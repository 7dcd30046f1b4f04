package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/e2e/testenv"
)

// BenchmarkShimGetTask: what one GET /api/tasks/{id} costs the shim (its
// CPU per call, read from /proc) and the caller (wall time), on a keep-alive
// connection as the server's client and a poller use it.
func BenchmarkShimGetTask(b *testing.B) {
	bins := testenv.Binaries(b)
	h := startShimTB(b, bins.Runner, nil, "--shim-log-level", "info")
	cfg := h.submit(api.TaskConfig{NetworkMode: "bridge"})
	h.wait(cfg.ID, time.Minute, func(i api.TaskInfoResponse) bool { return i.Status == api.TaskRunning })
	ctx := context.Background()
	pid := h.cmd.Process.Pid
	const per = 1000
	var cpu, self []time.Duration
	began := time.Now()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		before, self0 := processCPU(pid), selfCPU()
		for j := 0; j < per; j++ {
			if _, err := h.client.GetTask(ctx, cfg.ID); err != nil {
				b.Fatal(err)
			}
		}
		cpu, self = append(cpu, (processCPU(pid)-before)/per), append(self, (selfCPU()-self0)/per)
	}
	b.StopTimer()
	b.ReportMetric(float64(time.Since(began).Microseconds())/float64(b.N*per), "wall-us/get")
	b.ReportMetric(float64(median(cpu))*1000, "shim-cpu-us/get")
	// The client's side of the same GETs (this process: the typed client
	// tandem uses, on its transport), which shares the host's CPUs with
	// the shim whenever both run on one machine.
	b.ReportMetric(float64(median(self))*1000, "client-cpu-us/get")
	_, _ = h.client.TerminateTask(ctx, cfg.ID, api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser})
	h.wait(cfg.ID, time.Minute, func(i api.TaskInfoResponse) bool { return i.Status == api.TaskTerminated })
	_ = h.client.RemoveTask(ctx, cfg.ID)
}
