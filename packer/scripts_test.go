// Package packer holds the Packer template; its tests run the template's
// provisioning scripts for real, in a Debian container, against recording
// stand-ins for what cannot run here (apt-get, apt-mark, dpkg-query,
// systemctl, nvidia-ctk, curl, gpg, docker): NVIDIA's repositories and a
// GPU are out of reach, the scripts' decisions are not.
package packer

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/e2e/testenv"
)

// A stand-in records its name and arguments, one call per line, then does
// the little its caller needs from it.
const standIn = `#!/bin/bash
echo "$(basename "$0") $*" >>/record/calls
case "$(basename "$0")" in
curl) echo "deb https://nvidia.github.io/libnvidia-container/stable/deb/\$(ARCH) /" ;;
gpg) cat >/dev/null; for a; do [ "$prev" = -o ] && : >"$a"; prev=$a; done ;;
dpkg-query) if [[ "$*" == *db:Status-Abbrev* ]]; then [ -n "$STUB_COMPUTE" ] && echo "ii  $STUB_COMPUTE"; echo "un  libnvidia-compute-535-server "; exit 0; fi
  printf '%s\n' bash coreutils nvidia-container-toolkit nvidia-container-toolkit-base \
  nvidia-driver-580-server-open libnvidia-compute-580-server nvidia-utils-580-server nvidia-fabricmanager-580 \
  libnvidia-nscq-580 linux-modules-nvidia-580-server-open-generic nvidia-kernel-common-580-server \
  nvidia-firmware-580-server-580.178.04 nvidia-driver-570-server nvidia-utils-570-server \
  nvidia-driver-535-server libnvidia-compute-5800 ;;
docker) [ "$1" = login ] && cat >/dev/null; [ "$1" = pull ] && cat /etc/docker/daemon.json >>/record/daemon-at-pull ;;
systemctl) [ "$1" = is-active ] && exit 3 ;;
esac
exit 0
`

// run runs the scripts, in order, in a fresh container with env; it
// returns the recorded calls, the combined output and the container's
// files of interest (read back through /record), or the failing script's
// error.
func run(t *testing.T, env map[string]string, scripts ...string) (calls []string, out string, files map[string]string, err error) {
	t.Helper()
	testenv.RequireDocker(t)
	img := testenv.Debian(t)
	dir := t.TempDir()
	stubs, record, upload := filepath.Join(dir, "stubs"), filepath.Join(dir, "record"), filepath.Join(dir, "tandem")
	for _, d := range []string{stubs, record, upload} {
		if err := os.MkdirAll(d, 0o777); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range []string{"apt-get", "apt-mark", "dpkg-query", "systemctl", "nvidia-ctk", "curl", "gpg", "sysctl", "docker"} {
		if err := os.WriteFile(filepath.Join(stubs, name), []byte(standIn), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// What Packer uploads to /tmp/tandem.
	for _, f := range []string{"docker-data-root.sh", "tandem-docker-data-root.service"} {
		b, err := os.ReadFile(filepath.Join("..", "cloudinit", "scripts", f))
		if err != nil {
			t.Fatal(err)
		}
		_ = os.WriteFile(filepath.Join(upload, f), b, 0o644)
	}
	args := []string{"run", "--rm", "--network", "none",
		"-v", abs(t, "scripts") + ":/scripts:ro", "-v", stubs + ":/stubs:ro", "-v", record + ":/record", "-v", upload + ":/tmp/tandem",
		"-e", "PATH=/stubs:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "-e", "DEBIAN_FRONTEND=noninteractive"}
	// The real jq (the scripts edit daemon.json with it), from this
	// machine (Debian 12, as the image).
	for _, p := range []string{"/usr/bin/jq", "/lib/x86_64-linux-gnu/libjq.so.1", "/lib/x86_64-linux-gnu/libonig.so.5"} {
		real, err := filepath.EvalSymlinks(p)
		if err != nil {
			t.Skipf("jq from this machine: %v", err)
		}
		args = append(args, "-v", real+":"+p+":ro")
	}
	for k, v := range env {
		args = append(args, "-e", k+"="+v)
	}
	var body strings.Builder
	body.WriteString("set -e\n")
	for _, s := range scripts {
		body.WriteString("echo '>>> " + s + "'; bash /scripts/" + s + "\n")
	}
	// The files the assertions read, copied out.
	body.WriteString(`for f in /etc/apt/apt.conf.d/99-tandem-no-periodic /etc/sysctl.d/90-tandem.conf /etc/docker/daemon.json \
  /etc/systemd/system/nvidia-fabricmanager.service.d/tandem.conf /usr/local/lib/tandem/has-nvswitch \
  /etc/systemd/system/nvidia-cdi-refresh.service /etc/systemd/system/tandem-docker-data-root.service /etc/dstack/prepulled.env; do
  [ -f "$f" ] && cp "$f" "/record/$(echo "$f" | tr / _)"
done
# has-nvswitch against fixture PCI trees: an HGX board, then GPUs alone.
if [ -x /usr/local/lib/tandem/has-nvswitch ]; then
  mk() { mkdir -p "/fx/$1/bus/pci/devices/$2"; echo "$3" >"/fx/$1/bus/pci/devices/$2/vendor"; echo "$4" >"/fx/$1/bus/pci/devices/$2/class"; }
  mk hgx 0000:18:00.0 0x10de 0x030200; mk hgx 0000:05:00.0 0x10de 0x068000
  mk pcie 0000:18:00.0 0x10de 0x030200; mk pcie 0000:00:1f.0 0x8086 0x068000
  TANDEM_SYS=/fx/hgx /usr/local/lib/tandem/has-nvswitch && echo "nvswitch hgx: yes" >>/record/nvswitch || echo "nvswitch hgx: no" >>/record/nvswitch
  TANDEM_SYS=/fx/pcie /usr/local/lib/tandem/has-nvswitch && echo "nvswitch pcie: yes" >>/record/nvswitch || echo "nvswitch pcie: no" >>/record/nvswitch
fi
`)
	args = append(args, img, "bash", "-c", body.String())
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	b, err := exec.CommandContext(ctx, "docker", args...).CombinedOutput()
	calls = readLines(filepath.Join(record, "calls"))
	files = map[string]string{}
	entries, _ := os.ReadDir(record)
	for _, e := range entries {
		if c, rerr := os.ReadFile(filepath.Join(record, e.Name())); rerr == nil {
			files[e.Name()] = string(c)
		}
	}
	return calls, string(b), files, err
}

func abs(t *testing.T, p string) string {
	a, err := filepath.Abs(p)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func readLines(path string) []string {
	b, _ := os.ReadFile(path)
	var out []string
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		if l != "" {
			out = append(out, l)
		}
	}
	return out
}

func mustCall(t *testing.T, calls []string, want string) {
	t.Helper()
	if !slices.Contains(calls, want) {
		t.Fatalf("no call %q in:\n%s", want, strings.Join(calls, "\n"))
	}
}

func noCallStarting(t *testing.T, calls []string, prefix string) {
	t.Helper()
	for _, c := range calls {
		if strings.HasPrefix(c, prefix) {
			t.Fatalf("unexpected call %q", c)
		}
	}
}

var base = []string{"10-base.sh", "20-docker.sh", "30-nvidia.sh", "50-prepull.sh"}

// Both flavours: no background apt runs, the kernel tuning, Docker with
// live-restore and the data-root unit; the cpu flavour installs no NVIDIA
// stack and holds nothing.
func TestCPUFlavour(t *testing.T) {
	calls, out, files, err := run(t, map[string]string{"OS": "debian", "FLAVOR": "cpu"}, base...)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	mustCall(t, calls, "apt-get install -y -qq --no-install-recommends ca-certificates curl gnupg jq ufw pigz")
	mustCall(t, calls, "apt-get install -y -qq --no-install-recommends docker.io")
	mustCall(t, calls, "systemctl mask apt-daily.timer apt-daily-upgrade.timer apt-daily.service apt-daily-upgrade.service")
	mustCall(t, calls, "systemctl enable tandem-docker-data-root.service")
	noCallStarting(t, calls, "nvidia-ctk")
	noCallStarting(t, calls, "apt-mark")
	noCallStarting(t, calls, "docker ")
	periodic := files["_etc_apt_apt.conf.d_99-tandem-no-periodic"]
	for _, want := range []string{`APT::Periodic::Enable "0";`, `APT::Periodic::Unattended-Upgrade "0";`, `APT::Periodic::Update-Package-Lists "0";`} {
		if !strings.Contains(periodic, want) {
			t.Fatalf("apt periodic config lacks %s:\n%s", want, periodic)
		}
	}
	sysctl := files["_etc_sysctl.d_90-tandem.conf"]
	for _, want := range []string{"vm.swappiness = 1", "net.core.somaxconn = 4096", "net.core.rmem_max = 67108864", "net.core.wmem_max = 67108864", "vm.max_map_count = 1048576"} {
		if !strings.Contains(sysctl, want+"\n") {
			t.Fatalf("sysctl lacks %q:\n%s", want, sysctl)
		}
	}
	for _, l := range strings.Split(sysctl, "\n") {
		if strings.HasPrefix(l, "net.ipv4.ip_local_port_range") {
			t.Fatalf("the ephemeral port range is set: %s", l)
		}
	}
	if d := files["_etc_docker_daemon.json"]; !strings.Contains(d, `"live-restore": true`) || !strings.Contains(d, `"max-concurrent-downloads": 8`) {
		t.Fatalf("daemon.json: %s", d)
	}
	if u := files["_etc_systemd_system_tandem-docker-data-root.service"]; !strings.Contains(u, "Before=docker.service") {
		t.Fatalf("data-root unit: %s", u)
	}
	if !strings.Contains(out, "flavor cpu: no NVIDIA stack") || !strings.Contains(out, "prepull: no images") {
		t.Fatalf("output:\n%s", out)
	}
}

// The nvidia flavour per variable: the driver of the chosen branch and
// modules, Fabric Manager and NSCQ of the same version, the toolkit with
// its CDI unit, the three units enabled, Fabric Manager conditioned on an
// NVSwitch, and exactly that branch's packages held.
func TestNVIDIAFlavour(t *testing.T) {
	const exact = "580.178.04-0ubuntu0.24.04.1"
	held580 := []string{"libnvidia-compute-580-server", "libnvidia-nscq-580", "linux-modules-nvidia-580-server-open-generic",
		"nvidia-driver-580-server-open", "nvidia-fabricmanager-580", "nvidia-firmware-580-server-580.178.04",
		"nvidia-kernel-common-580-server", "nvidia-utils-580-server"}
	cases := []struct {
		version, modules, driver string
		held                     []string
		note                     string
	}{
		{"580", "open", "nvidia-driver-580-server-open", held580, ""},
		// Ubuntu's 570 is a transitional package of 580 (as in 2026):
		// Fabric Manager follows what is installed, and both are held.
		{"570", "proprietary", "nvidia-driver-570-server", []string{"libnvidia-compute-580-server", "libnvidia-nscq-580",
			"linux-modules-nvidia-580-server-open-generic", "nvidia-driver-570-server", "nvidia-driver-580-server-open",
			"nvidia-fabricmanager-580", "nvidia-firmware-580-server-580.178.04", "nvidia-kernel-common-580-server",
			"nvidia-utils-570-server", "nvidia-utils-580-server"}, "driver branch 570 is packaged as 580 in this archive"},
	}
	for _, c := range cases {
		t.Run(c.version+"-"+c.modules, func(t *testing.T) {
			calls, out, files, err := run(t, map[string]string{"OS": "ubuntu", "FLAVOR": "nvidia", "NVIDIA_DRIVER_VERSION": c.version, "NVIDIA_KERNEL_MODULES": c.modules,
				"STUB_COMPUTE": "libnvidia-compute-580-server " + exact}, base...)
			if err != nil {
				t.Fatalf("%v\n%s", err, out)
			}
			mustCall(t, calls, "apt-get install -y -qq --no-install-recommends "+c.driver+" nvidia-utils-"+c.version+"-server")
			mustCall(t, calls, "apt-get install -y -qq --no-install-recommends nvidia-fabricmanager-580="+exact+" libnvidia-nscq-580="+exact)
			if !strings.Contains(out, c.note) || !strings.Contains(out, "NVIDIA driver "+exact+" ("+c.modules+" modules), Fabric Manager "+exact) {
				t.Fatalf("output:\n%s", out)
			}
			mustCall(t, calls, "apt-get install -y -qq --no-install-recommends nvidia-container-toolkit")
			mustCall(t, calls, "nvidia-ctk runtime configure --runtime=docker")
			mustCall(t, calls, "systemctl enable nvidia-cdi-refresh.service nvidia-persistenced.service nvidia-fabricmanager.service")
			mustCall(t, calls, "apt-mark hold "+strings.Join(c.held, " "))
			mustCall(t, calls, "systemctl mask apt-daily.timer apt-daily-upgrade.timer apt-daily.service apt-daily-upgrade.service")
			if u := files["_etc_systemd_system_nvidia-fabricmanager.service.d_tandem.conf"]; !strings.Contains(u, "ExecCondition=/usr/local/lib/tandem/has-nvswitch") {
				t.Fatalf("fabric manager drop-in: %q", u)
			}
			if u := files["_etc_systemd_system_nvidia-cdi-refresh.service"]; !strings.Contains(u, "nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml") || !strings.Contains(u, "--device-name-strategy=uuid") {
				t.Fatalf("CDI unit: %q", u)
			}
			if got := files["nvswitch"]; got != "nvswitch hgx: yes\nnvswitch pcie: no\n" {
				t.Fatalf("has-nvswitch: %q", got)
			}
		})
	}
}

// Variables the flavour cannot build are refused, before anything is
// installed.
func TestNVIDIAFlavourRefusals(t *testing.T) {
	cases := []struct {
		name string
		env  map[string]string
		want string
	}{
		{"debian", map[string]string{"OS": "debian", "FLAVOR": "nvidia", "NVIDIA_DRIVER_VERSION": "570"}, "build the nvidia flavor with os=ubuntu"},
		{"no driver libraries after the install", map[string]string{"OS": "ubuntu", "FLAVOR": "nvidia", "NVIDIA_DRIVER_VERSION": "580"}, "expected one installed libnvidia-compute-N-server"},
		{"modules", map[string]string{"OS": "ubuntu", "FLAVOR": "nvidia", "NVIDIA_DRIVER_VERSION": "570", "NVIDIA_KERNEL_MODULES": "closed"}, "must be open or proprietary"},
		{"version", map[string]string{"OS": "ubuntu", "FLAVOR": "nvidia", "NVIDIA_DRIVER_VERSION": "570; rm -rf /"}, "must be a driver branch number"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			calls, out, _, err := run(t, c.env, "30-nvidia.sh")
			if err == nil || !strings.Contains(out, c.want) {
				t.Fatalf("want a refusal with %q: %v\n%s", c.want, err, out)
			}
			noCallStarting(t, calls, "apt-get install -y -qq --no-install-recommends nvidia-fabricmanager")
			noCallStarting(t, calls, "apt-mark")
		})
	}
}

// prepull_images: each pulled, in order, with the insecure registries in
// daemon.json during the pulls only.
func TestPrepull(t *testing.T) {
	calls, out, files, err := run(t, map[string]string{"OS": "debian", "FLAVOR": "cpu",
		"PREPULL_IMAGES": "10.0.2.2:5000/tandem/busybox:1 nvcr.io/nvidia/pytorch:25.01-py3", "PREPULL_INSECURE_REGISTRIES": "10.0.2.2:5000",
		"PREPULL_AUTH": `{"nvcr.io": {"username": "$oauthtoken", "password": "nv-secret key"}}`},
		"20-docker.sh", "50-prepull.sh")
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	// Logged in for the pulls (the password on stdin, never an argument),
	// out after them.
	mustCall(t, calls, "docker login --username $oauthtoken --password-stdin nvcr.io")
	mustCall(t, calls, "docker logout nvcr.io")
	if strings.Contains(strings.Join(calls, "\n"), "nv-secret") {
		t.Fatal("the registry password was an argument")
	}
	if i, j := slices.Index(calls, "docker pull -q nvcr.io/nvidia/pytorch:25.01-py3"), slices.Index(calls, "docker logout nvcr.io"); i < 0 || j < i {
		t.Fatalf("logout before the pulls: %q", calls)
	}
	var pulls []string
	for _, c := range calls {
		if strings.HasPrefix(c, "docker pull") {
			pulls = append(pulls, c)
		}
	}
	if !slices.Equal(pulls, []string{"docker pull -q 10.0.2.2:5000/tandem/busybox:1", "docker pull -q nvcr.io/nvidia/pytorch:25.01-py3"}) {
		t.Fatalf("pulls: %q", pulls)
	}
	if at := files["daemon-at-pull"]; strings.Count(at, `"10.0.2.2:5000"`) != 2 || !strings.Contains(at, `"live-restore": true`) {
		t.Fatalf("daemon.json during the pulls: %s", at)
	}
	if d := files["_etc_docker_daemon.json"]; strings.Contains(d, "insecure-registries") || !strings.Contains(d, `"live-restore": true`) {
		t.Fatalf("daemon.json after the build: %s", d)
	}
	// Image GC keeps what the image was built with.
	if e := files["_etc_dstack_prepulled.env"]; e != "TANDEM_SHIM_IMAGE_GC_KEEP=10.0.2.2:5000/tandem/busybox:1,nvcr.io/nvidia/pytorch:25.01-py3\n" {
		t.Fatalf("prepulled.env: %q", e)
	}
}
