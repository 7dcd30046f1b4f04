// Package vm holds the real-VM deployment tests (make vm-test): a Debian 12
// guest booted with QEMU gets Tandem the way a user's cloud VM does, from
// a NoCloud seed whose only user-data is `tandem cloudinit` output, or from
// the image the Packer template builds.
package vm

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/ctl"
	"github.com/tandem-run/tandem/e2e/testenv"
)

func TestMain(m *testing.M) {
	code := m.Run()
	if left := testenv.LeftoverDaemons(); len(left) > 0 {
		fmt.Fprintf(os.Stderr, "vm: daemons still running after the suite:\n  %s\n", strings.Join(left, "\n  "))
		code = 1
	}
	os.Exit(code)
}

// stack is what a guest fetches from the test: the agents, and a Debian
// mirror for apt.
type stack struct {
	bins testenv.Bins
	port int // GuestServer's loopback port
}

func newStack(t *testing.T) stack {
	bins := testenv.Binaries(t)
	return stack{bins: bins, port: testenv.GuestServer(t, map[string]string{"dstack-shim": bins.Shim, "dstack-runner": bins.Runner})}
}

// userData is `tandem cloudinit` for this guest, nothing added.
func (s stack) userData(t *testing.T, v *testenv.VM, extra ...string) string {
	t.Helper()
	args := []string{"cloudinit",
		"--shim-url", "http://" + testenv.GuestAddr + "/files/dstack-shim", "--shim-sha256", sum(t, s.bins.Shim),
		"--runner-url", "http://" + testenv.GuestAddr + "/files/dstack-runner", "--runner-sha256", sum(t, s.bins.Runner),
		"--authorized-key", v.PublicKey}
	out, err := exec.Command(s.bins.Tandem, append(args, extra...)...).Output()
	if err != nil {
		t.Fatalf("tandem cloudinit: %v", err)
	}
	return string(out)
}

func sum(t *testing.T, path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

// boot starts a guest of the image variant with user-data and waits for
// SSH and cloud-init; it returns cloud-init's status and whether it failed.
func boot(t *testing.T, ctx context.Context, s stack, variant string, extra ...string) (*testenv.VM, string, bool) {
	t.Helper()
	img := testenv.Guest(t, variant)
	v := testenv.NewVM(t)
	start := time.Now()
	v.Boot(testenv.BootOptions{Disk: img.Root, DiskFormat: "raw", Kernel: img.Kernel, Initrd: img.Initrd,
		UserData: s.userData(t, v, extra...), ServerPort: s.port})
	v.WaitSSH(ctx, 4*time.Minute)
	sshAt := time.Since(start)
	status, failed := v.WaitCloudInit(ctx)
	t.Logf("%s guest: SSH after %s, cloud-init finished after %s (failed=%v)", variant, sshAt.Round(time.Second), time.Since(start).Round(time.Second), failed)
	return v, status, failed
}

// unitState is systemd's view of dstack-shim.
func unitState(t *testing.T, ctx context.Context, v *testenv.VM) map[string]string {
	out := v.MustRun(ctx, "systemctl show dstack-shim.service -p Type -p ActiveState -p UnitFileState -p NRestarts -p SubState")
	m := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if k, val, ok := strings.Cut(line, "="); ok {
			m[k] = val
		}
	}
	return m
}

// waitActive waits for the shim to be active and its API to answer.
func waitActive(t *testing.T, ctx context.Context, v *testenv.VM, limit time.Duration) {
	t.Helper()
	deadline := time.Now().Add(limit)
	var out string
	for time.Now().Before(deadline) {
		var err error
		out, err = v.Run(ctx, "systemctl is-active dstack-shim.service && curl -sf http://localhost:10998/api/healthcheck", nil)
		if err == nil && strings.Contains(out, `"service":"dstack-shim"`) {
			return
		}
		time.Sleep(2 * time.Second)
	}
	t.Fatalf("dstack-shim not active and answering after %s: %s\n%s", limit, out, v.MustRun(ctx, "journalctl -u dstack-shim --no-pager | tail -n 30"))
}

// loadImage copies a test image from this machine's Docker into the
// guest's (the guest cannot reach a registry).
func loadImage(t *testing.T, ctx context.Context, v *testenv.VM, tag string) {
	t.Helper()
	img, err := exec.CommandContext(ctx, "docker", "save", tag).Output()
	if err != nil {
		t.Fatalf("docker save: %v", err)
	}
	if out, err := v.Run(ctx, "docker load", img); err != nil {
		t.Fatalf("docker load in the guest: %v\n%s", err, out)
	}
}

// tandem runs the client against the guest over SSH, as from a laptop.
func tandem(ctx context.Context, s stack, v *testenv.VM, args ...string) (string, string, error) {
	cmd := exec.CommandContext(ctx, s.bins.Tandem, args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	return out.String(), errb.String(), err
}

func sshFlags(v *testenv.VM) []string {
	return []string{"--ssh", v.SSHTarget(), "--identity", v.ClientKey, "--known-hosts", v.KnownHosts}
}

// TestCloudInitVM: a stock Debian 12 VM whose only user-data is `tandem
// cloudinit` runs the shim under systemd (Type=notify, active), answers,
// runs a job driven by `tandem run --ssh` (and a detached one that `tandem
// stats` and `tandem wait` reach over the same SSH), and has the shim back
// after a reboot.
func TestCloudInitVM(t *testing.T) {
	testenv.RequireDocker(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	s := newStack(t)
	image := testenv.Busybox(t)
	v, status, failed := boot(t, ctx, s, "full")
	if failed || !strings.Contains(status, "status: done") {
		t.Fatalf("cloud-init: %s\n%s", status, v.MustRun(ctx, "tail -n 30 /var/log/cloud-init-output.log"))
	}
	st := unitState(t, ctx, v)
	if st["Type"] != "notify" || st["ActiveState"] != "active" || st["UnitFileState"] != "enabled" {
		t.Fatalf("dstack-shim unit: %v", st)
	}
	waitActive(t, ctx, v, 30*time.Second)

	loadImage(t, ctx, v, image)
	start := time.Now()
	// On the host network the job's hostname is the VM's (on the bridge,
	// the default, it is its container's, as docker run's).
	out, errb, err := tandem(ctx, s, v, append([]string{"run", "--rm", "--network", "host"}, append(sshFlags(v), "--image", image, "--", "/bin/sh", "-c", "echo job ran on $(cat /proc/sys/kernel/hostname)")...)...)
	if err != nil || !strings.Contains(out, "job ran on tandem-vm") {
		t.Fatalf("tandem run --ssh: %v\n%s\n%s", err, out, errb)
	}
	t.Logf("job through tandem run --ssh: %s", time.Since(start).Round(100*time.Millisecond))
	if out, errb, err := tandem(ctx, s, v, append([]string{"info"}, sshFlags(v)...)...); err != nil || !strings.Contains(out, "health:    ok") {
		t.Fatalf("tandem info: %v\n%s\n%s", err, out, errb)
	}
	// A detached job seen over the same SSH: stats reads its runner through
	// the tunnel, wait prints its exit code.
	if out, errb, err := tandem(ctx, s, v, append(append([]string{"run", "-d"}, sshFlags(v)...), "--image", image, "--name", "nap", "--", "/bin/sh", "-c", "sleep 6; exit 7")...); err != nil {
		t.Fatalf("tandem run -d --ssh: %v\n%s\n%s", err, out, errb)
	}
	out, errb, err = tandem(ctx, s, v, append(append([]string{"stats"}, sshFlags(v)...), "--no-stream", "--interval", "1s", "-o", "json", "nap")...)
	var stats []ctl.Stat
	if err != nil || json.Unmarshal([]byte(out), &stats) != nil || len(stats) != 1 || stats[0].Name != "nap" ||
		stats[0].Error != "" || stats[0].CPUPercent == nil || stats[0].MemoryBytes == 0 {
		t.Fatalf("tandem stats --ssh: %v\n%s\n%s", err, out, errb)
	}
	if out, errb, err := tandem(ctx, s, v, append(append([]string{"wait"}, sshFlags(v)...), "nap")...); err != nil || strings.TrimSpace(out) != "7" {
		t.Fatalf("tandem wait --ssh: %v %q\n%s", err, out, errb)
	}
	t.Logf("over SSH: stats read %d bytes of memory in use, wait printed the job's 7", stats[0].MemoryBytes)

	took := v.Reboot(ctx, 4*time.Minute)
	waitActive(t, ctx, v, time.Minute)
	t.Logf("after a reboot: SSH after %s, shim active and answering", took.Round(time.Second))
	if st := unitState(t, ctx, v); st["Type"] != "notify" || st["ActiveState"] != "active" {
		t.Fatalf("dstack-shim after reboot: %v", st)
	}
}

// TestCloudInitVMFailures: an image the payload cannot work with fails
// loudly: cloud-init's status is error, the journal says what failed and
// how to fix it, and nothing restart-loops; without Docker the shim runs
// and reports the instance unhealthy, unless --install-docker installs it.
func TestCloudInitVMFailures(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	s := newStack(t)

	t.Run("no curl", func(t *testing.T) {
		v, status, failed := boot(t, ctx, s, "nocurl")
		if !failed || !strings.Contains(status, "status: error") {
			t.Fatalf("cloud-init must report the failed install:\n%s", status)
		}
		journal := v.MustRun(ctx, "journalctl -t tandem-install --no-pager -o cat")
		if strings.Count(journal, "neither curl nor wget") != 1 || !strings.Contains(journal, "apt-get install -y curl") {
			t.Fatalf("the journal must say what failed and the fix:\n%s", journal)
		}
		t.Logf("the user sees (journal, cloud-init-output.log): %s", strings.TrimSpace(journal))
		time.Sleep(10 * time.Second) // a restart loop (RestartSec=3) would show by now
		st := unitState(t, ctx, v)
		if st["UnitFileState"] == "enabled" || st["ActiveState"] == "active" || st["ActiveState"] == "activating" || st["NRestarts"] != "0" {
			t.Fatalf("a failed install must leave the unit disabled and still: %v", st)
		}
	})

	t.Run("no docker", func(t *testing.T) {
		v, status, failed := boot(t, ctx, s, "nodocker")
		if !failed || !strings.Contains(status, "status: error") {
			t.Fatalf("cloud-init must report the missing Docker:\n%s", status)
		}
		journal := v.MustRun(ctx, "journalctl -t tandem-install --no-pager -o cat")
		if !strings.Contains(journal, "Docker is not installed") || !strings.Contains(journal, "--install-docker") {
			t.Fatalf("journal:\n%s", journal)
		}
		t.Logf("the user sees: %s", strings.TrimSpace(journal))
		waitActive(t, ctx, v, 30*time.Second)
		// What the dstack server reads: /api/instance/health, a DCGM-shaped
		// failure whose first incident is the message it shows.
		health := v.MustRun(ctx, "curl -sf http://localhost:10998/api/instance/health")
		if !strings.Contains(health, `"overall_health":20`) || !strings.Contains(health, "Docker is not running on this host") {
			t.Fatalf("/api/instance/health: %s", health)
		}
		out, errb, err := tandem(ctx, s, v, append([]string{"info"}, sshFlags(v)...)...)
		if err != nil || !strings.Contains(out, "health:    failure: Docker is not running on this host") {
			t.Fatalf("tandem info must say why: %v\n%s\n%s", err, out, errb)
		}
		t.Logf("tandem info: %s", strings.TrimSpace(out))
		// A task submitted anyway fails, and is removed without Docker.
		out, errb, err = tandem(ctx, s, v, append([]string{"run", "--rm"}, append(sshFlags(v), "--image", "busybox", "--", "true")...)...)
		if err == nil || !strings.Contains(out+errb, "Cannot connect to the Docker daemon") {
			t.Fatalf("a job on a host without Docker: %v\n%s\n%s", err, out, errb)
		}
		ps, errb, err := tandem(ctx, s, v, append([]string{"ps", "-a"}, sshFlags(v)...)...)
		if err != nil || strings.Count(strings.TrimSpace(ps), "\n") != 0 {
			t.Fatalf("the failed task must be removed: %v\n%s\n%s", err, ps, errb)
		}
	})

	t.Run("install docker", func(t *testing.T) {
		v, status, failed := boot(t, ctx, s, "nodocker", "--install-docker")
		if failed {
			t.Fatalf("cloud-init with --install-docker:\n%s\n%s", status, v.MustRun(ctx, "tail -n 30 /var/log/cloud-init-output.log"))
		}
		waitActive(t, ctx, v, 30*time.Second)
		v.MustRun(ctx, "systemctl is-active docker && docker info --format '{{.ServerVersion}}'")
		if health := v.MustRun(ctx, "curl -sf http://localhost:10998/api/instance/health"); !strings.Contains(health, `"dcgm":null`) {
			t.Fatalf("health once Docker is installed: %s", health)
		}
	})
}
