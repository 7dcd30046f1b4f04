package vm

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tandem-run/tandem/e2e/testenv"
)

// TestPackerImage builds the Packer template's qemu source, os=debian, on
// the stock Debian guest (the template's scripts run unchanged, apt
// through the test's mirror proxy), then boots the image it made the way
// a cloud would and runs a job on it.
func TestPackerImage(t *testing.T) {
	testenv.RequireDocker(t)
	if _, err := exec.LookPath("packer"); err != nil {
		if testenv.InCI() {
			t.Fatal("packer missing (make deps installs it)")
		}
		t.Skip("packer missing (make deps installs it)")
	}
	// Two budgets, one per phase: the build (a TCG guest installing
	// Docker through apt, 8-14 minutes on a loaded 2-core CI machine) and
	// the boot of what it made with a job on it (4-8 minutes there). One
	// 15-minute budget for both ran out in CI with the build slow.
	buildCtx, cancelBuild := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancelBuild()
	ctx := buildCtx
	s := newStack(t)
	img := testenv.Guest(t, "full")
	image := testenv.Busybox(t)
	dir := t.TempDir()

	// The build logs in with a key of its own, through a NoCloud seed.
	key := filepath.Join(dir, "build_key")
	pub := testenv.KeyGen(t, key, "ed25519")
	seed := testenv.NoCloudSeed(t, filepath.Join(dir, "seed"), "#cloud-config\nssh_authorized_keys:\n  - "+pub+"\n", "packer-build", "packer-build")

	// prepull_images: an image in a registry with a login, reached over
	// plain HTTP (a guest forward to a real local registry).
	reg := testenv.StartRegistry(t)
	tag := "tandem-test/prepull:" + strings.ToLower(filepath.Base(dir))
	if _, err := testenv.Docker(ctx, "tag", image, tag); err != nil {
		t.Fatal(err)
	}
	reg.Push(t, tag, "e2e/prepulled:v1")
	const regInGuest = testenv.GuestAddr + ":5000"
	prepulled := regInGuest + "/e2e/prepulled:v1"

	out := filepath.Join(dir, "out")
	netdev := fmt.Sprintf("user,id=user.0,restrict=on,hostfwd=tcp:127.0.0.1:{{ .SSHHostPort }}-:22,guestfwd=tcp:%s:80-cmd:socat - TCP:127.0.0.1:%d,guestfwd=tcp:%s-cmd:socat - TCP:%s",
		testenv.GuestAddr, s.port, regInGuest, reg.Addr)
	vars := fmt.Sprintf(`os = "debian"
os_version = "12"
bin_dir = %q
qemu_image_url = %q
qemu_ssh_key = %q
qemu_seed_files = [%q, %q]
qemu_accelerator = "tcg"
qemu_output_dir = %q
prepull_images = [%q]
prepull_insecure_registries = [%q]
prepull_registry_auth = { %q = { username = %q, password = %q } }
qemu_args = [
  ["-m", "2048"], ["-smp", "2"],
  ["-kernel", %q], ["-initrd", %q], ["-append", "root=/dev/vda rw console=ttyS0 quiet"],
  ["-netdev", %q], ["-device", "virtio-net-pci,netdev=user.0,romfile="],
  ["-serial", %q],
]
`, filepath.Dir(s.bins.Shim), img.Root, key, seed[0], seed[1], out, prepulled, regInGuest, regInGuest, reg.Username, reg.Password,
		img.Kernel, img.Initrd, netdev, "file:"+filepath.Join(dir, "build-console.log"))
	varFile := filepath.Join(dir, "test.pkrvars.hcl")
	if err := os.WriteFile(varFile, []byte(vars), 0o644); err != nil {
		t.Fatal(err)
	}
	build := exec.CommandContext(buildCtx, "packer", "build", "-only=qemu.tandem", "-var-file="+varFile, ".")
	build.Dir = filepath.Join(testenv.ModuleRoot(), "packer")
	build.Env = append(os.Environ(), "PACKER_CACHE_DIR="+filepath.Join(dir, "cache"), "CHECKPOINT_DISABLE=1", "PACKER_NO_COLOR=1")
	testenv.Isolate(build)
	build.Cancel = func() error { return syscall.Kill(-build.Process.Pid, syscall.SIGKILL) }
	start := time.Now()
	log, err := build.CombinedOutput()
	if err != nil {
		console, _ := os.ReadFile(filepath.Join(dir, "build-console.log"))
		t.Fatalf("packer build: %v\n%s\nconsole:\n%s", err, testenv.Tail(log, 60), testenv.Tail(console, 30))
	}
	t.Logf("packer build (TCG, 2 vCPUs): %s", time.Since(start).Round(time.Second))
	if strings.Contains(string(log), reg.Password) {
		t.Fatal("the registry password is in the build log")
	}
	for _, want := range []string{"00-wait-cloud-init.sh", "status: done", "dstack-shim version", "flavor cpu: no NVIDIA stack", "prepull: " + prepulled} {
		if !strings.Contains(string(log), want) {
			t.Fatalf("packer build output lacks %q:\n%s", want, testenv.Tail(log, 60))
		}
	}
	built, _ := filepath.Glob(filepath.Join(out, "tandem-debian-12-cpu-*.qcow2"))
	if len(built) != 1 {
		entries, _ := os.ReadDir(out)
		t.Fatalf("the image is named after its OS: tandem-debian-12-cpu-*.qcow2, have %v", entries)
	}

	// The image boots like a cloud VM whose user-data is tandem cloudinit
	// --baked: the agents are there, nothing is downloaded.
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	v := testenv.NewVM(t)
	ud, err := exec.Command(s.bins.Tandem, "cloudinit", "--baked", "--authorized-key", v.PublicKey).Output()
	if err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	v.Boot(testenv.BootOptions{Disk: built[0], DiskFormat: "qcow2", Kernel: img.Kernel, Initrd: img.Initrd, UserData: string(ud)})
	v.WaitSSH(ctx, 4*time.Minute)
	if status, failed := v.WaitCloudInit(ctx); failed {
		t.Fatalf("cloud-init on the Packer image: %s\n%s", status, v.MustRun(ctx, "tail -n 30 /var/log/cloud-init-output.log"))
	}
	waitActive(t, ctx, v, time.Minute)
	t.Logf("Packer image: shim active and answering %s after boot", time.Since(start).Round(time.Second))
	if got := v.MustRun(ctx, "cat /etc/docker/daemon.json"); !strings.Contains(got, `"live-restore": true`) {
		t.Fatalf("20-docker.sh's daemon.json: %s", got)
	}
	// Nothing upgrades behind the operator's back; the kernel tuning; the
	// data-root mover ran before Docker and found no instance store.
	checks := map[string]string{
		"systemctl is-enabled apt-daily.timer apt-daily-upgrade.timer || true": "masked\nmasked",
		"apt-config dump APT::Periodic::Enable":                                `APT::Periodic::Enable "0";`,
		"sysctl -n vm.swappiness net.core.rmem_max":                            "1\n67108864",
		"systemctl is-enabled tandem-docker-data-root.service":                 "enabled",
		"journalctl -b -u tandem-docker-data-root.service --no-pager":          "no instance-store NVMe: Docker stays on the boot disk",
	}
	for cmd, want := range checks {
		if got := v.MustRun(ctx, cmd); !strings.Contains(got, want) {
			t.Fatalf("%s: %q, want %q", cmd, got, want)
		}
	}
	// The pre-pulled image is there, with no login left behind; the shim
	// starts a task on it with no pull (this VM has no way to the
	// registry: a pull would fail).
	if got := v.MustRun(ctx, "docker image inspect -f '{{.Id}}' "+prepulled+" && (grep -c 5000 /root/.docker/config.json 2>/dev/null || echo no-login)"); !strings.Contains(got, "sha256:") || !strings.Contains(got, "no-login") {
		t.Fatalf("pre-pulled image: %s", got)
	}
	o, errb, err := tandem(ctx, s, v, append([]string{"run"}, append(sshFlags(v), "--image", prepulled, "--", "/bin/sh", "-c", "echo prepulled job ran")...)...)
	if err != nil || !strings.Contains(o, "prepulled job ran") {
		t.Fatalf("tandem run on the pre-pulled image: %v\n%s\n%s", err, o, errb)
	}
	if got := v.MustRun(ctx, "journalctl -u dstack-shim --no-pager | grep -c 'image present, not pulling' || true"); strings.TrimSpace(got) == "0" {
		t.Fatalf("the shim pulled the pre-pulled image:\n%s", v.MustRun(ctx, "journalctl -u dstack-shim --no-pager | tail -n 20"))
	}
	loadImage(t, ctx, v, image)
	o, errb, err = tandem(ctx, s, v, append([]string{"run"}, append(sshFlags(v), "--image", image, "--", "/bin/sh", "-c", "echo baked job ran")...)...)
	if err != nil || !strings.Contains(o, "baked job ran") {
		t.Fatalf("tandem run on the Packer image: %v\n%s\n%s", err, o, errb)
	}
}
