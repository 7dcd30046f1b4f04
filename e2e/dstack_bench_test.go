package e2e

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/client"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/shimclient"
	"github.com/tandem-run/tandem/e2e/testenv"
	"github.com/tandem-run/tandem/shim/task"
)

// debianSSHD is Debian 12 with OpenSSH's server, which dstack's runner
// starts from the image (Tandem's embeds its own); built once from the
// test's Debian image with the machine's package mirror.
func debianSSHD(b *testing.B) string {
	b.Helper()
	const tag = "tandem-test/debian-sshd:bookworm"
	ctx := context.Background()
	if _, err := testenv.Docker(ctx, "image", "inspect", tag); err == nil {
		return tag
	}
	dir := b.TempDir()
	df := "FROM " + testenv.Debian(b) + "\nRUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openssh-server >/dev/null && rm -rf /var/lib/apt/lists/*\n"
	if err := os.WriteFile(filepath.Join(dir, "Dockerfile"), []byte(df), 0o644); err != nil {
		b.Fatal(err)
	}
	if out, err := testenv.Docker(ctx, "build", "-q", "-t", tag, dir); err != nil {
		b.Skipf("cannot build a Debian image with sshd here (no package mirror?): %v %s", err, out)
	}
	return tag
}

// BenchmarkStartVsDstack: submit to the runner's healthcheck answering,
// Tandem's agents beside dstack's (built from their source; the module
// proxy does not serve it) on one Docker engine, host network, a Debian
// image with sshd, with bare Docker making our container to the same
// answer as the floor. The three take turns in rotation (A B C, B C A,
// C A B), so each starts as often first, second and third: with A B C,
// C B A dstack's was always second, and by the engine's own clock Docker
// started its container 85.8 ms after create against 90.4 and 99.5 for
// the two sides at the ends (20 rounds, 2026-11-28); rotated, all three
// read 88-92 ms. TANDEM_DSTACK_BIN names the directory with dstack's
// `shim` and `runner`; skipped without it.
func BenchmarkStartVsDstack(b *testing.B) {
	dbin := os.Getenv("TANDEM_DSTACK_BIN")
	if dbin == "" {
		b.Skip("TANDEM_DSTACK_BIN (dstack's shim and runner, built from source) is not set")
	}
	img := debianSSHD(b)
	bins := testenv.Binaries(b)
	free := func() string { _, p, _ := net.SplitHostPort(testenv.FreeAddr(b)); return p }
	tRunner, tSSH := free(), free()
	ours := startShimTB(b, bins.Runner, nil, "--runner-http-port", tRunner, "--runner-ssh-port", tSSH)

	// dstack's shim, its own home, port and runner ports.
	dHome, dPort, dRunner, dSSH := b.TempDir(), free(), free(), free()
	testenv.UnmountUnder(b, dHome)
	cmd := exec.Command(filepath.Join(dbin, "shim"), "--shim-home", dHome, "--shim-http-port", dPort,
		"--runner-binary-path", filepath.Join(dbin, "runner"), "--runner-http-port", dRunner, "--runner-ssh-port", dSSH)
	logf, err := os.Create(filepath.Join(b.TempDir(), "dstack-shim.log"))
	if err != nil {
		b.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	testenv.StartDaemon(b, cmd)
	b.Cleanup(func() { // what a failed round left (both shims name them cmp-*)
		out, _ := testenv.Docker(context.Background(), "ps", "-aq", "--filter", "name=^cmp-")
		for _, id := range strings.Fields(out) {
			_, _ = testenv.Docker(context.Background(), "rm", "-f", id)
		}
	})
	theirs, _ := shimclient.New("127.0.0.1:" + dPort)
	ctx := context.Background()
	for i := 0; ; i++ {
		if _, err := theirs.Healthcheck(ctx); err == nil {
			break
		}
		if i > 200 {
			b.Fatal("dstack's shim did not answer")
		}
		time.Sleep(50 * time.Millisecond)
	}

	dc, err := client.NewClientWithOpts(client.FromEnv, client.WithAPIVersionNegotiation())
	if err != nil {
		b.Fatal(err)
	}
	defer dc.Close()
	var shape bareShape // our container, made again by hand: the floor
	trace := traceEngine(b, dc)
	var tSteps, dSteps, fSteps stepTimes
	start := func(c *shimclient.Client, runnerPort string, steps *stepTimes) time.Duration {
		id := randomID("cmp")
		cfg := api.TaskConfig{ID: id, Name: strings.ToLower(randomID("cmp")), ImageName: img, NetworkMode: "host", ContainerUser: "root"}
		began := time.Now()
		answered := make(chan error, 1)
		go func() { answered <- untilHealthy(runnerPort, 60*time.Second) }()
		if err := c.SubmitTask(ctx, cfg); err != nil {
			b.Fatal(err)
		}
		if err := <-answered; err != nil {
			b.Fatal(err)
		}
		answeredAt := time.Now()
		took := answeredAt.Sub(began)
		steps.add(trace.steps(b, cfg.Name, began, answeredAt))
		if c == ours.client && shape.cfg == nil {
			ins, err := dc.ContainerInspect(ctx, task.ContainerName(cfg.Name, cfg.ID))
			if err != nil {
				b.Fatal(err)
			}
			shape = bareShape{ins.Config, ins.HostConfig}
		}
		if _, err := c.TerminateTask(ctx, id, api.TaskTerminateRequest{TerminationReason: api.ReasonTerminatedByUser}); err != nil {
			b.Fatal(err)
		}
		for i := 0; ; i++ {
			if info, err := c.GetTask(ctx, id); err == nil && info.Status == api.TaskTerminated {
				break
			}
			if i > 600 {
				b.Fatal("task did not terminate")
			}
			time.Sleep(50 * time.Millisecond)
		}
		if err := c.RemoveTask(ctx, id); err != nil {
			b.Fatal(err)
		}
		return took
	}
	// Bare Docker, our container's shape, to the same answer: what no agent
	// that starts the job through Docker's API can beat.
	bare := func() time.Duration {
		began := time.Now()
		answered := make(chan error, 1)
		go func() { answered <- untilHealthy(tRunner, 60*time.Second) }()
		name := randomID("cmp-bare")
		id := shape.make(ctx, b, dc, name, tRunner, "")
		defer func() { _ = dc.ContainerRemove(ctx, id, container.RemoveOptions{Force: true}) }()
		if err := dc.ContainerStart(ctx, id, container.StartOptions{}); err != nil {
			b.Fatal(err)
		}
		if err := <-answered; err != nil {
			b.Fatal(err)
		}
		answeredAt := time.Now()
		fSteps.add(trace.steps(b, name, began, answeredAt))
		return answeredAt.Sub(began)
	}
	// Warm-ups.
	for range 2 {
		start(ours.client, tRunner, &stepTimes{})
		start(theirs, dRunner, &stepTimes{})
		bare()
	}
	fSteps = stepTimes{}
	var t, d, f []time.Duration
	var pairs, floor []float64 // ours, and bare Docker, over dstack's beside it
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		sides := []func(){
			func() { t = append(t, start(ours.client, tRunner, &tSteps)) },
			func() { d = append(d, start(theirs, dRunner, &dSteps)) },
			func() { f = append(f, bare()) },
		}
		for k := range sides {
			sides[(i+k)%len(sides)]()
		}
		pairs = append(pairs, float64(t[i])/float64(d[i]))
		floor = append(floor, float64(f[i])/float64(d[i]))
	}
	b.StopTimer()
	b.ReportMetric(median(t), "tandem-to-answer-ms")
	b.ReportMetric(median(d), "dstack-to-answer-ms")
	b.ReportMetric(median(f), "bare-docker-to-answer-ms")
	b.ReportMetric(median(t)/median(d), "tandem/dstack-ratio")
	b.ReportMetric(medianOf(pairs), "paired-ratio")
	b.ReportMetric(medianOf(floor), "bare-docker/dstack-paired-ratio")
	// Where the time goes, by the engine's clock, for each of the three.
	tSteps.report(b, "tandem")
	dSteps.report(b, "dstack")
	fSteps.report(b, "bare")
	if b.N >= 10 {
		target(b, "start vs dstack's agents (Debian with sshd, host)", medianOf(pairs), "<=", 0.85)
	}
}
