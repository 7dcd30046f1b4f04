package e2e

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/mount"
	"github.com/docker/docker/client"

	"github.com/tandem-run/tandem/api"
)

// Benchmarks of the shim on a warm local image, host network. Run with
// `make bench`; each reports medians in ms as custom metrics.

func median(d []time.Duration) float64 {
	s := slices.Clone(d)
	slices.Sort(s)
	return float64(s[len(s)/2].Microseconds()) / 1000
}

// httpdRunner stands in for dstack-runner: it serves /api/healthcheck on the
// runner port and exits on SIGTERM, as the real runner does.
const httpdRunner = `mkdir -p /tmp/www/api && echo '{"service":"dstack-runner"}' > /tmp/www/api/healthcheck && exec httpd -f -p 127.0.0.1:%d -h /tmp/www`

func BenchmarkShimSubmitToRunning(b *testing.B) {
	port := 20999
	h := startShimB(b, fmt.Sprintf(httpdRunner, port), "--runner-http-port", strconv.Itoa(port))
	dc, err := client.NewClientWithOpts(client.FromEnv, client.WithAPIVersionNegotiation())
	if err != nil {
		b.Fatal(err)
	}
	defer dc.Close()
	ctx := context.Background()
	bareRun := func(hc *container.HostConfig) time.Duration {
		start := time.Now()
		resp, err := dc.ContainerCreate(ctx, &container.Config{Image: h.image, Entrypoint: []string{"sleep"}, Cmd: []string{"60"}}, hc, nil, nil, randomID("bare"))
		if err == nil {
			err = dc.ContainerStart(ctx, resp.ID, container.StartOptions{})
		}
		took := time.Since(start)
		if err != nil {
			b.Fatal(err)
		}
		_ = dc.ContainerRemove(ctx, resp.ID, container.RemoveOptions{Force: true})
		return took
	}
	init := true
	// The same container a task gets: runner dir and runner binary binds.
	sameSpec := func() *container.HostConfig {
		dir := b.TempDir()
		return &container.HostConfig{NetworkMode: "host", Init: &init, Mounts: []mount.Mount{
			{Type: mount.TypeBind, Source: dir, Target: "/tmp/runner"},
			{Type: mount.TypeBind, Source: h.runner, Target: "/usr/local/bin/dstack-runner", ReadOnly: true},
		}}
	}
	var toRunning, toHealthy, bareMin, bare, terminate []time.Duration
	for i := 0; i < b.N; i++ {
		bareMin = append(bareMin, bareRun(&container.HostConfig{NetworkMode: "host", Init: &init}))
		bare = append(bare, bareRun(sameSpec()))
		start := time.Now()

		cfg := h.submit(api.TaskConfig{})
		for {
			info, err := h.client.GetTask(ctx, cfg.ID)
			if err != nil {
				b.Fatal(err)
			}
			if info.Status == api.TaskRunning {
				break
			}
			if info.Status == api.TaskTerminated {
				b.Fatalf("task ended: %+v", info)
			}
			time.Sleep(time.Millisecond)
		}
		toRunning = append(toRunning, time.Since(start))
		for {
			r, err := http.Get("http://127.0.0.1:" + strconv.Itoa(port) + "/api/healthcheck")
			if err == nil {
				r.Body.Close()
				if r.StatusCode == 200 {
					break
				}
			}
			time.Sleep(time.Millisecond)
		}
		toHealthy = append(toHealthy, time.Since(start))

		start = time.Now()
		if _, err := h.client.TerminateTask(ctx, cfg.ID, api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser, Timeout: 10}); err != nil {
			b.Fatal(err)
		}
		terminate = append(terminate, time.Since(start))
		if err := h.client.RemoveTask(ctx, cfg.ID); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(median(bareMin), "bare-minimal-ms")
	b.ReportMetric(median(bare), "bare-same-spec-ms")
	b.ReportMetric(median(toRunning), "submit-to-running-ms")
	b.ReportMetric(median(toRunning)/median(bare), "running/bare-ratio")
	b.ReportMetric(median(toHealthy), "submit-to-runner-health-ms")
	b.ReportMetric(median(terminate), "terminate-t10-ms")
	b.ReportMetric(float64(rssKiB(b, h.cmd.Process.Pid))/1024, "shim-rss-MiB")
}

// rssKiB is readRSS for a process that must be alive.
func rssKiB(b *testing.B, pid int) int {
	n := readRSS(pid)
	if n == 0 {
		b.Fatalf("no VmRSS for pid %d", pid)
	}
	return n
}
