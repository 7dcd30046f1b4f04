package cloudinit

import (
	"bytes"
	"compress/gzip"
	_ "embed"
	"encoding/base64"
	"fmt"
	"net"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"text/template"

	"gopkg.in/yaml.v3"

	"github.com/tandem-run/tandem/api"
)

// VM is how a VM gets dstack-shim: installed (or found baked into the
// image), configured with dstack's environment and supervised by systemd.
type VM struct {
	// Download URLs of the static binaries; not needed when Baked.
	ShimURL, RunnerURL       string
	ShimSHA256, RunnerSHA256 string
	// Baked: the image already has the binaries (Packer); URLs, if given,
	// are used only when a binary is missing.
	Baked          bool
	ShimHome       string // default /root/.dstack
	ShimHTTPPort   int    // 10998
	RunnerHTTPPort int    // 10999
	RunnerSSHPort  int    // 10022
	LogLevel       string // shim and runner; default "5" as the dstack server sets
	Privileged     bool
	PJRTDevice     string
	// Firewall: deny incoming except SSH and AllowCIDRs (default the private
	// ranges), with ufw when the image has it.
	Firewall       bool
	AllowCIDRs     []string
	AuthorizedKeys []string // for the default (provisioning) user
	Env            map[string]string
	// InstallDocker: install docker.io with apt when the image has no
	// Docker; without it such an image gets a running shim that reports
	// the instance unhealthy, and cloud-init reports the error.
	InstallDocker bool
	// KeepDockerDataRoot: leave Docker's data root where it is; by default
	// it moves to an instance-store NVMe when the host has one, at every
	// boot before Docker starts (scripts/docker-data-root.sh).
	KeepDockerDataRoot bool
}

// The data-root mover and its boot unit; Packer bakes the same two files.
var (
	//go:embed scripts/docker-data-root.sh
	dataRootScript string
	//go:embed scripts/tandem-docker-data-root.service
	dataRootUnit string
)

const (
	dataRootBin  = "/usr/local/lib/tandem/docker-data-root.sh"
	dataRootFile = "/etc/systemd/system/tandem-docker-data-root.service"
)

const (
	shimBin    = "/usr/local/bin/dstack-shim"
	runnerBin  = "/usr/local/bin/dstack-runner"
	envFile    = "/etc/dstack/shim.env"
	unitFile   = "/etc/systemd/system/dstack-shim.service"
	installBin = "/usr/local/lib/tandem/install-agents.sh"
)

var envName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

func (v *VM) defaults() {
	if v.ShimHome == "" {
		v.ShimHome = "/root/.dstack"
	}
	if v.ShimHTTPPort == 0 {
		v.ShimHTTPPort = api.ShimHTTPPort
	}
	if v.RunnerHTTPPort == 0 {
		v.RunnerHTTPPort = api.RunnerHTTPPort
	}
	if v.RunnerSSHPort == 0 {
		v.RunnerSSHPort = api.RunnerSSHPort
	}
	if v.LogLevel == "" {
		v.LogLevel = "5"
	}
	if v.Firewall && len(v.AllowCIDRs) == 0 {
		v.AllowCIDRs = []string{"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"}
	}
}

// Validate reports the first bad field by name.
func (v VM) Validate() error {
	v.defaults()
	if !v.Baked {
		if err := validURL("shim_url", v.ShimURL); err != nil {
			return err
		}
		if err := validURL("runner_url", v.RunnerURL); err != nil {
			return err
		}
	} else {
		for field, u := range map[string]string{"shim_url": v.ShimURL, "runner_url": v.RunnerURL} {
			if u != "" {
				if err := validURL(field, u); err != nil {
					return err
				}
			}
		}
	}
	for field, s := range map[string]string{"shim_sha256": v.ShimSHA256, "runner_sha256": v.RunnerSHA256} {
		if s != "" && !hexSHA.MatchString(s) {
			return fmt.Errorf("%s: %q is not a hex SHA-256", field, s)
		}
	}
	if !strings.HasPrefix(v.ShimHome, "/") || strings.ContainsAny(v.ShimHome, "'\"\\ \n$`") {
		return fmt.Errorf("shim_home: %q must be an absolute path without quotes or spaces", v.ShimHome)
	}
	for name, p := range map[string]int{"shim_http_port": v.ShimHTTPPort, "runner_http_port": v.RunnerHTTPPort, "runner_ssh_port": v.RunnerSSHPort} {
		if p < 1 || p > 65535 {
			return fmt.Errorf("%s: %d is not a port", name, p)
		}
	}
	if !regexp.MustCompile(`^[a-zA-Z1-6]+$`).MatchString(v.LogLevel) {
		return fmt.Errorf("log_level: %q", v.LogLevel)
	}
	if v.PJRTDevice != "" && !envName.MatchString(v.PJRTDevice) {
		return fmt.Errorf("pjrt_device: %q", v.PJRTDevice)
	}
	for _, c := range v.AllowCIDRs {
		if _, _, err := net.ParseCIDR(c); err != nil {
			return fmt.Errorf("allow_cidrs: %q is not a CIDR", c)
		}
	}
	if err := validKeys("authorized_keys", v.AuthorizedKeys); err != nil {
		return err
	}
	for k, val := range v.Env {
		if !envName.MatchString(k) {
			return fmt.Errorf("env: %q is not a variable name", k)
		}
		if strings.ContainsAny(val, "\"\\\n$`") {
			return fmt.Errorf("env %s: value has a quote, backslash, dollar, backtick or newline", k)
		}
	}
	return nil
}

// unitFor is the systemd service for layout l: after Docker and the
// network, restarted on failure but not forever.
func unitFor(l Layout) string {
	return `[Unit]
Description=dstack-shim (Tandem): runs dstack tasks as Docker containers
Documentation=https://github.com/tandem-run/tandem
After=network-online.target docker.service
Wants=network-online.target docker.service
# A binary that is not there is not started (no restart loop); one that
# keeps failing is given up on after 20 tries in 10 minutes (see
# systemctl status); a Docker that comes up late does not stop the shim.
ConditionFileIsExecutable=` + l.ShimBin() + `
StartLimitIntervalSec=600
StartLimitBurst=20

[Service]
# notify: active once the API serves and tasks are recovered; the watchdog
# restarts a shim that stops answering itself.
Type=notify
NotifyAccess=main
WatchdogSec=60
TimeoutStartSec=300
User=root
EnvironmentFile=` + l.EnvFile() + `
# The images a Packer build pulled into the machine image: image GC keeps
# them (packer/scripts/50-prepull.sh writes it; none: no file).
EnvironmentFile=-` + filepath.Join(filepath.Dir(l.EnvFile()), "prepulled.env") + `
ExecStart=` + l.ShimBin() + `
Restart=always
RestartSec=3
KillMode=process
LimitNOFILE=1048576

[Install]
WantedBy=multi-user.target
`
}

// unit is the systemd service at the standard paths.
var unit = unitFor(Layout{})

// envLines is the EnvironmentFile with dstack's variables (sorted).
func (v VM) envLines() string { return v.envLinesFor(Layout{}) }

func (v VM) envLinesFor(l Layout) string {
	env := map[string]string{
		"DSTACK_SHIM_HOME":          v.ShimHome,
		"DSTACK_SHIM_HTTP_PORT":     fmt.Sprint(v.ShimHTTPPort),
		"DSTACK_SHIM_LOG_LEVEL":     v.LogLevel,
		"DSTACK_RUNNER_BINARY_PATH": l.RunnerBin(),
		"DSTACK_RUNNER_HTTP_PORT":   fmt.Sprint(v.RunnerHTTPPort),
		"DSTACK_RUNNER_SSH_PORT":    fmt.Sprint(v.RunnerSSHPort),
		"DSTACK_RUNNER_LOG_LEVEL":   v.LogLevel,
	}
	if v.RunnerURL != "" {
		env["DSTACK_RUNNER_DOWNLOAD_URL"] = v.RunnerURL
	}
	if v.Privileged {
		env["DSTACK_DOCKER_PRIVILEGED"] = "true"
	}
	if v.PJRTDevice != "" {
		env["PJRT_DEVICE"] = v.PJRTDevice
	}
	for k, val := range v.Env {
		env[k] = val
	}
	keys := make([]string, 0, len(env))
	for k := range env {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "%s=\"%s\"\n", k, env[k])
	}
	return b.String()
}

// installer downloads (with retries and checksums) or reuses the binaries,
// checks Docker (installing it when asked), optionally sets up the
// firewall, then enables and starts the shim. Idempotent. Every failure
// exits non-zero with what failed and how to fix it, on stderr (cloud-init's
// log and `cloud-init status`) and in the journal, and leaves the unit
// disabled: a host that cannot run the shim never restart-loops it.
var installerTmpl = template.Must(template.New("i").Parse(`#!/bin/bash
# Installs and starts Tandem's dstack-shim and dstack-runner (rendered by
# tandem cloudinit). Run it again after fixing what it reported.
set -euo pipefail
self={{.Self}}
fail() {
  echo "tandem: $*" >&2
  logger -p user.err -t tandem-install -- "$*" 2>/dev/null || true
  exit 1
}
warn() {
  echo "tandem: $*" >&2
  logger -p user.warning -t tandem-install -- "$*" 2>/dev/null || true
}
download() { # url dest
  if command -v curl >/dev/null; then
    curl -fsSL --connect-timeout 10 -m 600 -o "$2" "$1"
  else
    wget -q -T 10 -O "$2" "$1"
  fi
}
fetch() { # url dest sha256
  local url=$1 dest=$2 sum=$3 tmp i err
  command -v curl >/dev/null || command -v wget >/dev/null ||
    fail "cannot download $url: this image has neither curl nor wget. Install curl (apt-get install -y curl), or use an image with the agents baked in (packer/), then run $self again."
  tmp=$(mktemp "${dest}.XXXXXX")
  for i in 1 2 3 4 5 6; do
    if err=$(download "$url" "$tmp" 2>&1); then break; fi
    if [ "$i" = 6 ]; then
      rm -f "$tmp"
      fail "cannot download $url after 6 tries (${err:-no error text}). Check that this host reaches it, then run $self again."
    fi
    sleep $((i * 2))
  done
  if [ -n "$sum" ] && ! echo "$sum  $tmp" | sha256sum -c - >/dev/null; then
    rm -f "$tmp"; fail "checksum mismatch for $url: the file is not the release it should be; check the URL and its SHA-256"
  fi
  chmod 0755 "$tmp"
  mv -f "$tmp" "$dest"
}
have() { [ -x "$1" ] && "$1" --version >/dev/null 2>&1; }
runs() { # bin: it must run here (a too-old glibc shows up now, not as a restart loop)
  local out
  out=$("$1" --version 2>&1) || fail "$1 does not run on this host: ${out}. dstack-shim needs glibc 2.31 or newer (Ubuntu 20.04, Debian 11)."
}
mkdir -p /usr/local/bin {{printf "%q" .ShimHome}}
{{- if .Baked}}
have {{.ShimBin}} || {{if .ShimURL}}fetch '{{.ShimURL}}' {{.ShimBin}} '{{.ShimSHA256}}'{{else}}fail "{{.ShimBin}} is not baked into this image; build it with packer/ or render the payload with --shim-url"{{end}}
have {{.RunnerBin}} || {{if .RunnerURL}}fetch '{{.RunnerURL}}' {{.RunnerBin}} '{{.RunnerSHA256}}'{{else}}fail "{{.RunnerBin}} is not baked into this image; build it with packer/ or render the payload with --runner-url"{{end}}
{{- else}}
fetch '{{.ShimURL}}' {{.ShimBin}} '{{.ShimSHA256}}'
fetch '{{.RunnerURL}}' {{.RunnerBin}} '{{.RunnerSHA256}}'
{{- end}}
runs {{.ShimBin}}
runs {{.RunnerBin}}
{{- if not .KeepDockerDataRoot}}
# Docker's data root on the instance-store NVMe, if any, before Docker
# starts (or moved, Docker stopped meanwhile); at every boot after this.
systemctl daemon-reload
systemctl enable {{.DataRootUnit}} >/dev/null 2>&1 || warn "could not enable {{.DataRootUnit}}"
{{.DataRootBin}} || warn "Docker's data root was not moved to the instance store (see above): Docker stays on the boot disk"
{{- end}}
docker_missing=
if ! command -v dockerd >/dev/null; then
{{- if .InstallDocker}}
  command -v apt-get >/dev/null || fail "Docker is missing and this image has no apt-get to install it; use an image with Docker, then run $self again."
  echo "tandem: installing Docker (docker.io)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get -q -o APT::Update::Error-Mode=any update >&2 || fail "cannot install Docker: apt-get update failed (see above). Check this host's package mirror, then run $self again."
  apt-get -q -y install docker.io pigz >&2 || fail "cannot install Docker: apt-get install docker.io failed (see above), then run $self again."
{{- else}}
  docker_missing=1
{{- end}}
fi
# Pulls: Docker unpacks each layer with unpigz (all cores) where it is
# installed, else with one core of gzip; and it downloads more layers at
# once than its default 3 (a value the operator set in daemon.json is
# kept; Docker takes it on reload).
if ! command -v unpigz >/dev/null && command -v apt-get >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get -q -y install pigz >&2 ||
    { apt-get -q update >&2 && DEBIAN_FRONTEND=noninteractive apt-get -q -y install pigz >&2; } ||
    warn "pigz not installed: Docker unpacks each pulled layer on one core"
fi
pulls=0
command -v python3 >/dev/null && mkdir -p /etc/docker && python3 - /etc/docker/daemon.json <<'PY' || pulls=$?
import json, os, sys
p = sys.argv[1]
try:
    with open(p) as f:
        d = json.load(f)
except FileNotFoundError:
    d = {}
if "max-concurrent-downloads" in d:
    sys.exit(3)
d["max-concurrent-downloads"] = 8
with open(p + ".tandem", "w") as f:
    json.dump(d, f, indent=2)
    f.write("\n")
os.replace(p + ".tandem", p)
PY
case $pulls in
  0) systemctl reload docker.service >/dev/null 2>&1 || true ;;
  3) ;;
  *) warn "Docker's max-concurrent-downloads not set: no python3, or /etc/docker/daemon.json unreadable" ;;
esac
if [ -z "$docker_missing" ]; then
  systemctl enable --now docker.service >/dev/null 2>&1 || warn "Docker is installed but did not start: see systemctl status docker"
fi
{{- if .Firewall}}
if command -v ufw >/dev/null; then
  ufw --force reset >/dev/null
  ufw default deny incoming
  ufw default allow outgoing
  ufw allow ssh
{{- range .AllowCIDRs}}
  ufw allow from {{.}}
{{- end}}
  ufw --force enable
else
  warn "ufw not found; firewall left as is"
fi
{{- end}}
systemctl daemon-reload
systemctl enable --now dstack-shim.service || fail "dstack-shim did not start: see journalctl -u dstack-shim"
if [ -n "$docker_missing" ]; then
  fail "Docker is not installed, so no task can start; the shim runs and reports the instance unhealthy. Install it (apt-get install -y docker.io) or render the payload with tandem cloudinit --install-docker."
fi
`))

type installerData struct {
	VM
	ShimBin, RunnerBin, Self  string
	DataRootBin, DataRootUnit string
}

func (v VM) installer() (string, error) {
	var b bytes.Buffer
	err := installerTmpl.Execute(&b, installerData{VM: v, ShimBin: shimBin, RunnerBin: runnerBin, Self: installBin,
		DataRootBin: dataRootBin, DataRootUnit: filepath.Base(dataRootFile)})
	return b.String(), err
}

type writeFile struct {
	Path        string `yaml:"path"`
	Permissions string `yaml:"permissions"`
	Owner       string `yaml:"owner"`
	Encoding    string `yaml:"encoding,omitempty"`
	Content     string `yaml:"content"`
}

// gzipBase64 is content as write_files' gz+b64 encoding carries it: EC2
// takes at most 16 KiB of user data, and the data-root mover alone is
// 14 KiB as text.
func gzipBase64(content string) string {
	var b bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&b, gzip.BestCompression)
	_, _ = zw.Write([]byte(content))
	_ = zw.Close()
	return base64.StdEncoding.EncodeToString(b.Bytes())
}

type cloudConfig struct {
	SSHAuthorizedKeys []string    `yaml:"ssh_authorized_keys,omitempty"`
	WriteFiles        []writeFile `yaml:"write_files"`
	Runcmd            [][]string  `yaml:"runcmd"`
}

// startCmds: the installer alone, which enables the unit last, so that a
// failed install leaves nothing enabled and fails cloud-init's runcmd.
var startCmds = [][]string{{installBin}}

// prepared fills defaults, validates, and renders the installer both
// payloads carry.
func (v VM) prepared() (VM, string, error) {
	v.defaults()
	if err := v.Validate(); err != nil {
		return v, "", err
	}
	inst, err := v.installer()
	return v, inst, err
}

// UserData renders the #cloud-config payload.
func (v VM) UserData() (string, error) {
	v, inst, err := v.prepared()
	if err != nil {
		return "", err
	}
	cc := cloudConfig{
		SSHAuthorizedKeys: v.AuthorizedKeys,
		WriteFiles: []writeFile{
			// Compressed: EC2's 16 KiB holds the installer only so.
			{Path: installBin, Permissions: "0755", Owner: "root:root", Encoding: "gz+b64", Content: gzipBase64(inst)},
			{Path: envFile, Permissions: "0600", Owner: "root:root", Content: v.envLines()},
			{Path: unitFile, Permissions: "0644", Owner: "root:root", Content: unit},
		},
		Runcmd: startCmds,
	}
	if !v.KeepDockerDataRoot {
		cc.WriteFiles = append(cc.WriteFiles,
			writeFile{Path: dataRootBin, Permissions: "0755", Owner: "root:root", Encoding: "gz+b64", Content: gzipBase64(dataRootScript)},
			writeFile{Path: dataRootFile, Permissions: "0644", Owner: "root:root", Content: dataRootUnit})
	}
	b, err := yaml.Marshal(cc)
	if err != nil {
		return "", err
	}
	return "#cloud-config\n" + string(b), nil
}

// Script renders the same as a startup script, for clouds that take one
// instead of cloud-config.
func (v VM) Script() (string, error) {
	v, inst, err := v.prepared()
	if err != nil {
		return "", err
	}
	var b strings.Builder
	b.WriteString("#!/bin/bash\n# Tandem: install and supervise dstack-shim (rendered by tandem cloudinit --script).\nset -euo pipefail\n")
	file := func(path, mode, content string) {
		fmt.Fprintf(&b, "mkdir -p %q\ncat > %q <<'TANDEM_EOF'\n%sTANDEM_EOF\nchmod %s %q\n", dirOf(path), path, content, mode, path)
	}
	file(installBin, "0755", inst)
	file(envFile, "0600", v.envLines())
	file(unitFile, "0644", unit)
	if !v.KeepDockerDataRoot {
		file(dataRootBin, "0755", dataRootScript)
		file(dataRootFile, "0644", dataRootUnit)
	}
	if len(v.AuthorizedKeys) > 0 {
		b.WriteString("mkdir -p /root/.ssh && chmod 700 /root/.ssh\n")
		for _, k := range v.AuthorizedKeys {
			fmt.Fprintf(&b, "grep -qxF '%s' /root/.ssh/authorized_keys 2>/dev/null || echo '%s' >> /root/.ssh/authorized_keys\n", k, k)
		}
		b.WriteString("chmod 600 /root/.ssh/authorized_keys\n")
	}
	for _, c := range startCmds {
		b.WriteString(strings.Join(c, " ") + "\n")
	}
	return b.String(), nil
}

func dirOf(p string) string {
	i := strings.LastIndexByte(p, '/')
	if i <= 0 {
		return "/"
	}
	return p[:i]
}
