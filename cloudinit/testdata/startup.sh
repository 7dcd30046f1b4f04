#!/bin/bash
# Tandem: install and supervise dstack-shim (rendered by tandem cloudinit --script).
set -euo pipefail
mkdir -p "/usr/local/lib/tandem"
cat > "/usr/local/lib/tandem/install-agents.sh" <<'TANDEM_EOF'
#!/bin/bash
# Installs Tandem's dstack-shim and dstack-runner (rendered by tandem cloudinit).
set -euo pipefail
fetch() { # url dest sha256
  local url=$1 dest=$2 sum=$3 tmp i
  tmp=$(mktemp "${dest}.XXXXXX")
  for i in 1 2 3 4 5 6; do
    if curl -fsSL --connect-timeout 10 -m 600 -o "$tmp" "$url"; then break; fi
    if [ "$i" = 6 ]; then rm -f "$tmp"; echo "tandem: cannot download $url" >&2; exit 1; fi
    sleep $((i * 2))
  done
  if [ -n "$sum" ] && ! echo "$sum  $tmp" | sha256sum -c - >/dev/null; then
    rm -f "$tmp"; echo "tandem: checksum mismatch for $url" >&2; exit 1
  fi
  chmod 0755 "$tmp"
  mv -f "$tmp" "$dest"
}
have() { [ -x "$1" ] && "$1" --version >/dev/null 2>&1; }
mkdir -p /usr/local/bin "/root/.dstack"
have /usr/local/bin/dstack-shim || { echo "tandem: /usr/local/bin/dstack-shim is not baked into this image" >&2; exit 1; }
have /usr/local/bin/dstack-runner || { echo "tandem: /usr/local/bin/dstack-runner is not baked into this image" >&2; exit 1; }
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
  echo "tandem: ufw not found; firewall left as is" >&2
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
StartLimitIntervalSec=0

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
systemctl daemon-reload
systemctl enable --now dstack-shim.service
