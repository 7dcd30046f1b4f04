package ctl

import (
	"bytes"
	"context"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/cloudinit"
)

// HostOptions install (or remove) the agents on a machine reached over SSH,
// as dstack's SSH fleets do: the same env file and unit `tandem cloudinit`
// renders, or a supervisor where systemd is not PID 1.
type HostOptions struct {
	Target SSHTarget
	Layout cloudinit.Layout
	VM     cloudinit.VM // ports, privileged, env; URLs are ignored
	// ShimBinary and RunnerBinary are local files; empty: Dist's for the
	// host's architecture (dist/<version>/dstack-shim-linux-<arch>).
	ShimBinary, RunnerBinary string
	Dist                     string
	// Progress receives the install's steps as EventInfo events (nil:
	// none are shown); the library writes to no stream itself.
	Progress func(Event)
	// Force lets uninstall stop a shim that still has tasks.
	Force bool
	// Clock is what waits run on (nil: the real one).
	Clock Clock
}

// remoteHost is a connected machine with how to run commands as root there.
type remoteHost struct {
	t        *Tunnel
	clock    Clock
	sudo     bool
	arch     string // amd64, arm64
	systemd  bool
	docker   string // server version
	dockerOK bool
	dockerNo string // why not
	glibc    string // "2.36"; empty: none found (musl, or no getconf)
}

const hostPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$PATH; "

// run runs a shell command as root on the host.
func (h *remoteHost) run(ctx context.Context, cmd string, stdin io.Reader) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute) // no command of ours takes longer
	defer cancel()
	cmd = hostPath + cmd
	if h.sudo {
		cmd = "sudo -n sh -c " + shellQuote(cmd)
	}
	out, _, err := h.t.Run(ctx, cmd, stdin)
	return string(out), err
}

func connectHost(ctx context.Context, o HostOptions) (*remoteHost, error) {
	t, err := DialSSH(ctx, o.Target)
	if err != nil {
		return nil, err
	}
	h := &remoteHost{t: t, clock: clockOr(o.Clock)}
	probe := `echo "arch=$(uname -m)"; echo "uid=$(id -u)"; echo "glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null)"
if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then echo systemd=1; else echo systemd=0; fi
if command -v docker >/dev/null 2>&1; then
  if v=$(docker version --format '{{.Server.Version}}' 2>&1); then echo "docker=$v"; else echo "docker_error=$(echo "$v" | tr '\n' ' ')"; fi
elif [ -S /var/run/docker.sock ]; then echo docker=unknown; else echo "docker_error=no docker command and no /var/run/docker.sock"; fi
if [ "$(id -u)" != 0 ]; then sudo -n true 2>/dev/null && echo sudo=1 || echo sudo=0; fi`
	out, _, err := t.Run(ctx, hostPath+probe, nil)
	if err != nil {
		t.Close()
		return nil, fmt.Errorf("probe %s: %w", o.Target.Target, err)
	}
	if err := h.parseProbe(string(out)); err != nil {
		t.Close()
		return nil, fmt.Errorf("%s: %w", o.Target.Target, err)
	}
	return h, nil
}

// parseProbe reads the probe's key=value lines into h.
func (h *remoteHost) parseProbe(out string) error {
	kv := map[string]string{}
	for _, line := range strings.Split(out, "\n") {
		if k, v, ok := strings.Cut(line, "="); ok {
			kv[k] = strings.TrimSpace(v)
		}
	}
	switch kv["arch"] {
	case "x86_64", "amd64":
		h.arch = "amd64"
	case "aarch64", "arm64":
		h.arch = "arm64"
	default:
		return fmt.Errorf("architecture %q is not supported (amd64 and arm64 are)", kv["arch"])
	}
	if kv["uid"] != "0" {
		if kv["sudo"] != "1" {
			return errors.New("the login is not root and has no passwordless sudo (sudo -n true failed); the shim must run as root")
		}
		h.sudo = true
	}
	h.systemd = kv["systemd"] == "1"
	h.glibc = strings.TrimPrefix(kv["glibc"], "glibc ")
	h.docker, h.dockerOK, h.dockerNo = kv["docker"], kv["docker"] != "", kv["docker_error"]
	return nil
}

// canRun refuses a host whose C library is older than the one the
// (cgo-linked) binary was built against: the loader would refuse it at
// every start, and systemd would restart it until it gave up.
func (h *remoteHost) canRun(bin string) error {
	need, err := glibcNeeded(bin)
	if err != nil || need == "" {
		return err // a static binary needs no C library
	}
	switch {
	case h.glibc == "":
		return fmt.Errorf("%s needs glibc %s and the host has no glibc (getconf GNU_LIBC_VERSION answered nothing; musl-based systems such as Alpine cannot run it)", filepath.Base(bin), need)
	case versionLess(h.glibc, need):
		return fmt.Errorf("%s needs glibc %s, the host has %s: use a release built for older hosts (make release builds the shim against glibc 2.31: Ubuntu 20.04, Debian 11)", filepath.Base(bin), need, h.glibc)
	}
	return nil
}

// glibcNeeded is the newest GLIBC_x.y symbol version that an ELF binary
// imports, or "" for one that needs no glibc.
func glibcNeeded(file string) (string, error) {
	f, err := elf.Open(file)
	if err != nil {
		return "", fmt.Errorf("%s: %w", file, err)
	}
	defer f.Close()
	syms, err := f.ImportedSymbols()
	if err != nil {
		return "", nil // no dynamic symbols: static
	}
	need := ""
	for _, s := range syms {
		if v, ok := strings.CutPrefix(s.Version, "GLIBC_"); ok && (need == "" || versionLess(need, v)) {
			need = v
		}
	}
	return need, nil
}

// versionLess compares dotted decimal versions ("2.9" < "2.31").
func versionLess(a, b string) bool {
	as, bs := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; i < len(as) || i < len(bs); i++ {
		var x, y int
		if i < len(as) {
			x, _ = strconv.Atoi(as[i])
		}
		if i < len(bs) {
			y, _ = strconv.Atoi(bs[i])
		}
		if x != y {
			return x < y
		}
	}
	return false
}

// elfMachine maps our arch names to ELF machines.
var elfMachine = map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}

// checkBinary verifies a local file is an ELF executable for arch.
func checkBinary(file, arch string) error {
	f, err := elf.Open(file)
	if err != nil {
		return fmt.Errorf("%s: not an ELF executable: %w", file, err)
	}
	defer f.Close()
	if f.Machine != elfMachine[arch] {
		return fmt.Errorf("%s is built for %s, the host is %s", file, f.Machine, arch)
	}
	return nil
}

func sha256File(file string) (string, error) {
	f, err := os.Open(file)
	if err != nil {
		return "", err
	}
	defer f.Close()
	sum := sha256.New()
	if _, err := io.Copy(sum, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(sum.Sum(nil)), nil
}

// binaries picks the local files to upload for arch.
func (o HostOptions) binaries(arch string) (shim, runner string, err error) {
	shim, runner = o.ShimBinary, o.RunnerBinary
	if shim == "" || runner == "" {
		dist := o.Dist
		if dist == "" {
			return "", "", withHint(HintBinaries, errors.New("no agent binaries given"))
		}
		if shim == "" {
			shim = filepath.Join(dist, "dstack-shim-linux-"+arch)
		}
		if runner == "" {
			runner = filepath.Join(dist, "dstack-runner-linux-"+arch)
		}
	}
	for _, f := range []string{shim, runner} {
		if err := checkBinary(f, arch); err != nil {
			return "", "", err
		}
	}
	return shim, runner, nil
}

// put writes content to dst on the host (mode), through dst.tandem-new and
// a rename, and reports whether the file changed.
func (h *remoteHost) put(ctx context.Context, dst string, mode string, content io.Reader, runVersion bool) (bool, error) {
	tmp := dst + ".tandem-new"
	cmd := fmt.Sprintf("set -e; mkdir -p %s; cat > %s; chmod %s %s", shellQuote(path.Dir(dst)), shellQuote(tmp), mode, shellQuote(tmp))
	if runVersion {
		cmd += fmt.Sprintf("; %[1]s --version >/dev/null || { rm -f %[1]s; echo 'the new binary does not run here' >&2; exit 1; }", shellQuote(tmp))
	}
	cmd += fmt.Sprintf("; if cmp -s %[1]s %[2]s; then rm -f %[1]s; else mv -f %[1]s %[2]s; echo changed; fi", shellQuote(tmp), shellQuote(dst))
	out, err := h.run(ctx, cmd, content)
	if err != nil {
		return false, fmt.Errorf("write %s: %w", dst, err)
	}
	return strings.Contains(out, "changed"), nil
}

// upload copies a local binary unless the host has the same bytes.
func (h *remoteHost) upload(ctx context.Context, local, dst string) (bool, error) {
	sum, err := sha256File(local)
	if err != nil {
		return false, err
	}
	out, _ := h.run(ctx, "sha256sum "+shellQuote(dst)+" 2>/dev/null", nil)
	if strings.HasPrefix(out, sum) {
		return false, nil
	}
	f, err := os.Open(local)
	if err != nil {
		return false, err
	}
	defer f.Close()
	// --version runs the new file before it replaces the old one: a broken
	// or foreign binary never becomes the installed one.
	return h.put(ctx, dst, "0755", f, true)
}

// HostReport is what an install did.
type HostReport struct {
	Arch, Docker, Supervisor string
	Changed                  []string
	Restarted                bool
	Health                   api.HealthcheckResponse
}

// InstallHost installs or upgrades the agents on the host and waits until
// the shim answers through the SSH connection. Idempotent: unchanged files
// are left alone and the shim restarts only when something changed; the
// shim keeps its tasks across the restart (their containers run on).
func InstallHost(ctx context.Context, o HostOptions) (HostReport, error) {
	var rep HostReport
	files, err := o.VM.Host(o.Layout)
	if err != nil {
		return rep, err
	}
	h, err := connectHost(ctx, o)
	if err != nil {
		return rep, err
	}
	defer h.t.Close()
	rep.Arch, rep.Docker = h.arch, h.docker
	if err := h.requireDocker(); err != nil {
		return rep, fmt.Errorf("%s %w", o.Target.Target, err)
	}
	shimBin, runnerBin, err := o.binaries(h.arch)
	if err != nil {
		return rep, err
	}
	if err := h.canRun(shimBin); err != nil {
		return rep, fmt.Errorf("%s: %w", o.Target.Target, err)
	}
	say(o.Progress).status("host %s: %s, Docker %s, %s", o.Target.Target, h.arch, h.docker, map[bool]string{true: "systemd", false: "no systemd (supervisor script)"}[h.useSystemd(o.Layout)])
	l := o.Layout
	for _, b := range []struct{ local, dst string }{{runnerBin, l.RunnerBin()}, {shimBin, l.ShimBin()}} {
		changed, err := h.upload(ctx, b.local, b.dst)
		if err != nil {
			return rep, err
		}
		if changed {
			rep.Changed = append(rep.Changed, b.dst)
		}
	}
	write := func(dst, mode, content string) error {
		changed, err := h.put(ctx, dst, mode, strings.NewReader(content), false)
		if changed {
			rep.Changed = append(rep.Changed, dst)
		}
		return err
	}
	if err := write(l.EnvFile(), "0600", files.Env); err != nil {
		return rep, err
	}
	port := o.VM.ShimHTTPPort
	if port == 0 {
		port = api.ShimHTTPPort
	}
	if h.useSystemd(l) {
		rep.Supervisor = "systemd"
		if err := write(l.UnitFile(), "0644", files.Unit); err != nil {
			return rep, err
		}
		verb := "start"
		if len(rep.Changed) > 0 {
			verb, rep.Restarted = "restart", true
		}
		if _, err := h.run(ctx, "systemctl daemon-reload && systemctl enable dstack-shim.service && systemctl "+verb+" dstack-shim.service", nil); err != nil {
			return rep, fmt.Errorf("systemctl: %w", err)
		}
	} else {
		rep.Supervisor = "supervisor script"
		supChanged, err := h.put(ctx, l.Supervisor(), "0755", strings.NewReader(files.Supervisor), false)
		if err != nil {
			return rep, err
		}
		if supChanged {
			rep.Changed = append(rep.Changed, l.Supervisor())
		}
		restarted, err := h.superviseStart(ctx, l, supChanged, len(rep.Changed) > 0)
		if err != nil {
			return rep, err
		}
		rep.Restarted = restarted
	}
	hc, err := waitShim(ctx, h.clock, h.t, port, 90*time.Second)
	if err != nil {
		log, _ := h.run(ctx, "tail -n 20 "+shellQuote(l.RunDir()+"/shim.log")+" 2>/dev/null || journalctl -u dstack-shim -n 20 --no-pager 2>/dev/null", nil)
		return rep, fmt.Errorf("the shim did not answer on port %d: %w\n%s", port, err, log)
	}
	rep.Health = hc
	return rep, nil
}

func (h *remoteHost) requireDocker() error {
	if !h.dockerOK {
		return fmt.Errorf("has no working Docker (%s): install it first (Debian/Ubuntu: apt-get install docker.io) and re-run", h.dockerNo)
	}
	return nil
}

func (h *remoteHost) useSystemd(l cloudinit.Layout) bool { return h.systemd && l.Prefix == "" }

// superviseStart starts the supervisor when it is not running (a new
// script replaces the old supervisor), or restarts only the shim when its
// files changed. It reports whether a running shim was restarted.
func (h *remoteHost) superviseStart(ctx context.Context, l cloudinit.Layout, scriptChanged, filesChanged bool) (bool, error) {
	run := shellQuote(l.RunDir())
	alive, _ := h.run(ctx, fmt.Sprintf("p=$(cat %s/supervisor.pid 2>/dev/null) && kill -0 \"$p\" 2>/dev/null && echo alive", run), nil)
	running := strings.Contains(alive, "alive")
	oldShim, _ := h.run(ctx, fmt.Sprintf("cat %s/shim.pid 2>/dev/null", run), nil)
	oldShim = strings.TrimSpace(oldShim)
	// Only the supervisor goes to the background, with none of the SSH
	// session's descriptors: otherwise the session stays open for as long
	// as it runs.
	start := fmt.Sprintf("mkdir -p %[1]s && cd / && { setsid nohup %[2]s >>%[1]s/supervisor.log 2>&1 </dev/null & } ; sleep 0.2", run, shellQuote(l.Supervisor()))
	switch {
	case running && scriptChanged:
		if _, err := h.run(ctx, fmt.Sprintf("kill $(cat %s/supervisor.pid); for i in $(seq 50); do [ -e %s/supervisor.pid ] || break; sleep 0.1; done", run, run), nil); err != nil {
			return false, fmt.Errorf("stop the old supervisor: %w", err)
		}
		_, err := h.run(ctx, start, nil)
		return true, err
	case running && filesChanged:
		// The supervisor starts the new binary 3 s after the old one exits.
		if _, err := h.run(ctx, fmt.Sprintf("kill $(cat %s/shim.pid)", run), nil); err != nil {
			return false, fmt.Errorf("restart the shim: %w", err)
		}
	case running:
		return false, nil
	default:
		_, err := h.run(ctx, start, nil)
		return false, err
	}
	// Wait for the new shim process, so the health check below is its.
	err := poll(ctx, h.clock, 200*time.Millisecond, 30*time.Second, func() (bool, error) {
		now, _ := h.run(ctx, fmt.Sprintf("cat %s/shim.pid 2>/dev/null", run), nil)
		now = strings.TrimSpace(now)
		return now != "" && now != oldShim, nil
	})
	if errors.Is(err, errWaitedOut) {
		err = errors.New("the supervisor did not restart the shim within 30 s")
	}
	return true, err
}

// waitShim polls the shim's healthcheck through the tunnel.
func waitShim(ctx context.Context, clk Clock, t *Tunnel, port int, limit time.Duration) (api.HealthcheckResponse, error) {
	c, err := localShim(t, port, clk)
	if err != nil {
		return api.HealthcheckResponse{}, err
	}
	var hc api.HealthcheckResponse
	err = poll(ctx, clk, 300*time.Millisecond, limit, func() (bool, error) {
		hctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		defer cancel()
		var err error
		hc, err = c.shim.Healthcheck(hctx)
		if err == nil && hc.Service != api.ServiceShim {
			err = fmt.Errorf("answered as %q", hc.Service)
		}
		return err == nil, err
	})
	return hc, err
}

// localShim is a client of the shim on the host's own loopback, port
// port, through the tunnel t.
func localShim(t *Tunnel, port int, clk Clock) (*Client, error) {
	return NewClient(Config{Shim: joinPort("127.0.0.1", port), Dial: t.Dial, Clock: clk})
}

// UninstallHost stops the shim and removes what InstallHost wrote. The
// shim's home (task records) stays. A shim with tasks is left alone unless
// Force: their containers would outlive their supervisor.
func UninstallHost(ctx context.Context, o HostOptions) error {
	if err := o.Layout.Validate(); err != nil {
		return err
	}
	h, err := connectHost(ctx, o)
	if err != nil {
		return err
	}
	defer h.t.Close()
	port := o.VM.ShimHTTPPort
	if port == 0 {
		port = api.ShimHTTPPort
	}
	if c, err := localShim(h.t, port, h.clock); err == nil {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		items, lerr := c.shim.ListTasks(cctx)
		cancel()
		var live []string
		for _, it := range items {
			if it.Status != api.TaskTerminated {
				live = append(live, ShortID(it.ID))
			}
		}
		if lerr == nil && len(live) > 0 && !o.Force {
			return withHint(HintForce, fmt.Errorf("the shim has %d task(s) not terminated (%s): stop them first", len(live), strings.Join(live, ", ")))
		}
	}
	l := o.Layout
	var b bytes.Buffer
	if h.useSystemd(l) {
		b.WriteString("systemctl disable --now dstack-shim.service 2>/dev/null; rm -f " + shellQuote(l.UnitFile()) + "; systemctl daemon-reload; ")
	}
	run := shellQuote(l.RunDir())
	fmt.Fprintf(&b, "p=$(cat %[1]s/supervisor.pid 2>/dev/null) && kill \"$p\" 2>/dev/null; for i in $(seq 50); do [ -e %[1]s/supervisor.pid ] || break; sleep 0.1; done; ", run)
	fmt.Fprintf(&b, "p=$(cat %[1]s/shim.pid 2>/dev/null) && kill \"$p\" 2>/dev/null; ", run)
	fmt.Fprintf(&b, "rm -f %s %s %s %s; rm -rf %s; echo removed", shellQuote(l.ShimBin()), shellQuote(l.RunnerBin()), shellQuote(l.EnvFile()), shellQuote(l.Supervisor()), run)
	if _, err := h.run(ctx, b.String(), nil); err != nil {
		return fmt.Errorf("uninstall: %w", err)
	}
	// The shim must be gone: its port no longer answers.
	err = poll(ctx, h.clock, 300*time.Millisecond, 15*time.Second, func() (bool, error) {
		_, err := waitShim(ctx, h.clock, h.t, port, 0)
		return err != nil, nil
	})
	if errors.Is(err, errWaitedOut) {
		return fmt.Errorf("the shim on port %d still answers after uninstall", port)
	}
	return err
}
