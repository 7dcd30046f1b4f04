#!/bin/bash
# Tandem: install and supervise dstack-shim (rendered by tandem cloudinit --script).
set -euo pipefail
mkdir -p "/usr/local/lib/tandem"
cat > "/usr/local/lib/tandem/install-agents.sh" <<'TANDEM_EOF'
#!/bin/bash
# Installs and starts Tandem's dstack-shim and dstack-runner (rendered by
# tandem cloudinit). Run it again after fixing what it reported.
set -euo pipefail
self=/usr/local/lib/tandem/install-agents.sh
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
mkdir -p /usr/local/bin "/root/.dstack"
have /usr/local/bin/dstack-shim || fail "/usr/local/bin/dstack-shim is not baked into this image; build it with packer/ or render the payload with --shim-url"
have /usr/local/bin/dstack-runner || fail "/usr/local/bin/dstack-runner is not baked into this image; build it with packer/ or render the payload with --runner-url"
runs /usr/local/bin/dstack-shim
runs /usr/local/bin/dstack-runner
docker_missing=
if ! command -v dockerd >/dev/null; then
  docker_missing=1
fi
if [ -z "$docker_missing" ]; then
  systemctl enable --now docker.service >/dev/null 2>&1 || warn "Docker is installed but did not start: see systemctl status docker"
fi
if command -v ufw >/dev/null; then
  ufw --force reset >/dev/null
  ufw default deny incoming
  ufw default allow outgoing
  ufw allow ssh
  ufw allow from 10.0.0.0/8
  ufw allow from 172.16.0.0/12
  ufw allow from 192.168.0.0/16
  ufw --force enable
else
  warn "ufw not found; firewall left as is"
fi
systemctl daemon-reload
systemctl enable --now dstack-shim.service || fail "dstack-shim did not start: see journalctl -u dstack-shim"
if [ -n "$docker_missing" ]; then
  fail "Docker is not installed, so no task can start; the shim runs and reports the instance unhealthy. Install it (apt-get install -y docker.io) or render the payload with tandem cloudinit --install-docker."
fi
TANDEM_EOF
chmod 0755 "/usr/local/lib/tandem/install-agents.sh"
mkdir -p "/etc/dstack"
cat > "/etc/dstack/shim.env" <<'TANDEM_EOF'
DSTACK_RUNNER_BINARY_PATH="/usr/local/bin/dstack-runner"
DSTACK_RUNNER_HTTP_PORT="10999"
DSTACK_RUNNER_LOG_LEVEL="5"
DSTACK_RUNNER_SSH_PORT="10022"
DSTACK_SHIM_HOME="/root/.dstack"
DSTACK_SHIM_HTTP_PORT="10998"
DSTACK_SHIM_LOG_LEVEL="5"
HF_HOME="/data/hf"
TANDEM_EOF
chmod 0600 "/etc/dstack/shim.env"
mkdir -p "/etc/systemd/system"
cat > "/etc/systemd/system/dstack-shim.service" <<'TANDEM_EOF'
[Unit]
Description=dstack-shim (Tandem): runs dstack tasks as Docker containers
Documentation=https://github.com/tandem-run/tandem
After=network-online.target docker.service
Wants=network-online.target docker.service
# A binary that is not there is not started (no restart loop); one that
# keeps failing is given up on after 20 tries in 10 minutes (see
# systemctl status); a Docker that comes up late does not stop the shim.
ConditionFileIsExecutable=/usr/local/bin/dstack-shim
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
EnvironmentFile=/etc/dstack/shim.env
ExecStart=/usr/local/bin/dstack-shim
Restart=always
RestartSec=3
KillMode=process
LimitNOFILE=1048576

[Install]
WantedBy=multi-user.target
TANDEM_EOF
chmod 0644 "/etc/systemd/system/dstack-shim.service"
mkdir -p /root/.ssh && chmod 700 /root/.ssh
grep -qxF 'ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGa6ZRd7ZG7JXqZbWbKJ3b7h5pI6kY0cUQYvV0c8m1pF user@laptop' /root/.ssh/authorized_keys 2>/dev/null || echo 'ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGa6ZRd7ZG7JXqZbWbKJ3b7h5pI6kY0cUQYvV0c8m1pF user@laptop' >> /root/.ssh/authorized_keys
chmod 600 /root/.ssh/authorized_keys
/usr/local/lib/tandem/install-agents.sh
