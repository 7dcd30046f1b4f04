package e2e

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/runnerclient"
	"github.com/tandem-run/tandem/e2e/testenv"
	"github.com/tandem-run/tandem/shim/netiso"
	"github.com/tandem-run/tandem/shim/task"
)

// bridgeRunner submits a bridge-mode task with the real runner and returns
// a client of its runner through the port the shim published on the host,
// as the dstack server reaches it, and the container's address on its
// network.
func bridgeRunner(t *testing.T, h *shimHarness, runnerPort string) (api.TaskInfoResponse, *runnerHarness, string) {
	t.Helper()
	cfg := h.submit(api.TaskConfig{NetworkMode: "bridge"})
	info := h.wait(cfg.ID, 60*time.Second, func(i api.TaskInfoResponse) bool {
		return i.Status == api.TaskRunning || i.Status == api.TaskTerminated
	})
	if info.Status != api.TaskRunning {
		t.Fatalf("bridge task did not run: %+v", info)
	}
	var published string
	for _, p := range info.Ports {
		if strconv.Itoa(p.Container) == runnerPort {
			published = strconv.Itoa(p.Host)
		}
	}
	if published == "" {
		t.Fatalf("no published runner port: %+v", info.Ports)
	}
	c, err := runnerclient.New("127.0.0.1:" + published)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, err := c.Healthcheck(context.Background()); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("runner of %s does not answer on %s", cfg.ID, published)
		}
		time.Sleep(50 * time.Millisecond)
	}
	ip, err := testenv.Docker(context.Background(), "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}", task.ContainerName(cfg.Name, cfg.ID))
	if err != nil {
		t.Fatal(err)
	}
	return info, &runnerHarness{t: t, client: c}, strings.TrimSpace(ip)
}

// TestBridgeTasksCannotReachEachOther: tenant A's job tries what an attacker
// tried against dstack's agents (read B's log, stop B, take C's runner)
// through the container addresses on the bridge. It reaches none of them;
// the controls show the network is not simply cut: A's own job runs and
// reaches a service the host publishes, and B's owner drives B through its
// published port.
func TestBridgeTasksCannotReachEachOther(t *testing.T) {
	h, _, runnerPort := realStack(t)
	ctx := context.Background()

	// A service on the host, on the bridge gateway's side (every address).
	hostLn, err := net.Listen("tcp", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	hostSrv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, "host-service-ok") })}
	go func() { _ = hostSrv.Serve(hostLn) }()
	t.Cleanup(func() { _ = hostSrv.Close() })
	hostPort := strconv.Itoa(hostLn.Addr().(*net.TCPAddr).Port)

	_, b, bIP := bridgeRunner(t, h, runnerPort)
	_, c, cIP := bridgeRunner(t, h, runnerPort)
	_, a, _ := bridgeRunner(t, h, runnerPort)

	// The network is the shim's, isolated.
	opt, err := testenv.Docker(ctx, "network", "inspect", "-f", `{{index .Options "`+netiso.OptICC+`"}}`, netiso.DefaultName)
	if err != nil || strings.TrimSpace(opt) != "false" {
		t.Fatalf("isolated network: %q %v", opt, err)
	}

	// B runs its owner's job holding a secret; its owner reads the log.
	bJob := job("/bin/sh", "-c", "echo B-SECRET-4711; sleep 120")
	b.start(bJob)
	deadline := time.Now().Add(20 * time.Second)
	for {
		p, err := b.client.Peek(ctx, 0)
		if err == nil && logsHave(p, "B-SECRET-4711") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("B's owner cannot read B's log: %+v %v", p, err)
		}
		time.Sleep(100 * time.Millisecond)
	}

	gw, err := testenv.Docker(ctx, "network", "inspect", "-f", "{{range .IPAM.Config}}{{.Gateway}}{{end}}", netiso.DefaultName)
	if err != nil {
		t.Fatal(err)
	}
	// busybox nc (static busybox's wget resolves through NSS and crashes).
	probe := func(name, addr, method, path string) string {
		return fmt.Sprintf(`if printf '%s %s HTTP/1.0\r\nHost: localhost\r\n\r\n' | nc -w 3 %s > /tmp/%s 2>&1 && grep -q '^HTTP/' /tmp/%s; then echo %s=REACHED; cat /tmp/%s; echo; else echo %s=BLOCKED; fi`,
			method, path, addr, name, name, name, name, name)
	}
	bAddr, cAddr := bIP+" "+runnerPort, cIP+" "+runnerPort
	attack := job("/bin/sh", "-c", strings.Join([]string{
		probe("host", strings.TrimSpace(gw)+" "+hostPort, "GET", "/"),
		probe("bpull", bAddr, "GET", "/api/pull?timestamp=0"),
		probe("bhealth", bAddr, "GET", "/api/healthcheck"),
		probe("bstop", bAddr, "POST", "/api/stop"),
		probe("chealth", cAddr, "GET", "/api/healthcheck"),
		"echo A-DONE"}, "; "))
	a.start(attack)
	out := a.pullUntilDone(60*time.Second, nil).logs.String()
	t.Logf("A's job:\n%s", out)
	if !strings.Contains(out, "A-DONE") {
		t.Fatalf("control: A's own job did not run to its end: %q", out)
	}
	if !strings.Contains(out, "host=REACHED") || !strings.Contains(out, "host-service-ok") {
		t.Fatalf("control: A's job must still reach a service the host publishes: %q", out)
	}
	for _, probe := range []string{"bpull", "bhealth", "bstop", "chealth"} {
		if !strings.Contains(out, probe+"=BLOCKED") {
			t.Errorf("%s: A reached another task's runner: %q", probe, out)
		}
	}
	if strings.Contains(out, "B-SECRET-4711") {
		t.Error("B's secret reached A's output")
	}
	// B still runs its owner's job; C's owner still gets C's runner.
	if p, err := b.client.Peek(ctx, 0); err != nil || len(p.JobStates) == 0 || p.JobStates[len(p.JobStates)-1].State != api.JobRunning {
		t.Fatalf("B after the attack: %+v %v", p, err)
	}
	c.start(job("/bin/sh", "-c", "echo C-OWNER-JOB"))
	if got := c.pullUntilDone(30*time.Second, nil).logs.String(); !strings.Contains(got, "C-OWNER-JOB") {
		t.Fatalf("C's owner's job: %q", got)
	}
}

func logsHave(p api.PullResponse, s string) bool {
	for _, l := range p.JobLogs {
		if strings.Contains(string(l.Message), s) {
			return true
		}
	}
	return false
}

// TestIsolatedNetworkRefusesAnImpostor: a network of the shim's name that
// lets containers talk (made by someone else) is never used: the task fails
// with the fix in its message.
func TestIsolatedNetworkRefusesAnImpostor(t *testing.T) {
	name := randomID("tandem-impostor")
	if _, err := testenv.Docker(context.Background(), "network", "create", name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = testenv.Docker(context.Background(), "network", "rm", name) })
	h := startShim(t, runnerScript(t, "sleep 60"), nil, "--task-network", name)
	cfg := h.submit(api.TaskConfig{NetworkMode: "bridge"})
	info := h.wait(cfg.ID, 30*time.Second, terminated)
	if info.TerminationReason != api.ReasonCreatingContainerError || !strings.Contains(info.TerminationMessage, "lets its containers reach each other") {
		t.Fatalf("impostor network: %+v", info)
	}
	// Control: host mode does not need the network.
	cfg = h.submit(api.TaskConfig{})
	h.wait(cfg.ID, 30*time.Second, running)
}
