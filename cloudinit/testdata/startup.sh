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
# Docker's data root on the instance-store NVMe, if any, before Docker
# starts (or moved, Docker stopped meanwhile); at every boot after this.
systemctl daemon-reload
systemctl enable tandem-docker-data-root.service >/dev/null 2>&1 || warn "could not enable tandem-docker-data-root.service"
/usr/local/lib/tandem/docker-data-root.sh || warn "Docker's data root was not moved to the instance store (see above): Docker stays on the boot disk"
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
mkdir -p "/usr/local/lib/tandem"
cat > "/usr/local/lib/tandem/docker-data-root.sh" <<'TANDEM_EOF'
#!/bin/bash
# Docker's data root on the instance-store NVMe, when the host has one:
# multi-GB images and layers belong on the fast local disk, not the boot
# disk. Runs at every boot before Docker (tandem-docker-data-root.service)
# and from the cloud-init payload; idempotent.
#
# Never formats a disk that holds data (the rule volumes follow): a disk is
# formatted only when it has no partitions, no filesystem or RAID signature
# blkid knows and its first and last MiB read as zeros, as a fresh instance
# store does. A disk this script formatted carries the label
# tandem-ephemeral and is mounted again after a reboot. A data root the
# operator chose in daemon.json is left alone.
#
# Instance stores are told apart from network disks by their NVMe model:
# "Amazon EC2 NVMe Instance Storage", "Microsoft NVMe Direct Disk" (Azure),
# "nvme_card" (Google Cloud local SSD; its persistent disks are
# "nvme_card-pd"). The first such disk is used.
set -euo pipefail
SYS=${TANDEM_SYS:-/sys}
DEV=${TANDEM_DEV:-/dev}
MNT=${TANDEM_EPHEMERAL_MOUNT:-/mnt/ephemeral}
DAEMON_JSON=${TANDEM_DOCKER_DAEMON_JSON:-/etc/docker/daemon.json}
DEFAULT_ROOT=${TANDEM_DOCKER_DEFAULT_ROOT:-/var/lib/docker}
LABEL=tandem-ephemeral
log() { echo "tandem-docker-data-root: $*" >&2; }

# daemon.json is read and written with python3, which every host with
# cloud-init has (jq may not be installed yet).
json_get() { # key: its value in daemon.json, empty when unset
  [ -f "$DAEMON_JSON" ] || return 0
  python3 -c 'import json,sys; v=json.load(open(sys.argv[1])).get(sys.argv[2]); print(v if v is not None else "")' "$DAEMON_JSON" "$1"
}
json_set() { # key value: set in daemon.json, the rest kept
  python3 - "$DAEMON_JSON" "$1" "$2" <<'PY'
import json, os, sys
path, key, value = sys.argv[1:]
try:
    with open(path) as f:
        cfg = json.load(f)
except FileNotFoundError:
    cfg = {}
cfg[key] = value
with open(path + ".new", "w") as f:
    json.dump(cfg, f, indent=2)
    f.write("\n")
os.replace(path + ".new", path)
PY
}

want="$MNT/docker"
if [ -f "$DAEMON_JSON" ]; then
  current=$(json_get data-root)
  if [ -n "$current" ] && [ "$current" != "$want" ]; then
    log "daemon.json sets data-root to $current: left as the operator chose"
    exit 0
  fi
fi

instance_store() {
  local b model
  for b in "$SYS"/block/nvme*n*; do
    [ -e "$b/device/model" ] || continue
    case "$(basename "$b")" in *p[0-9]*) continue ;; esac
    model=$(tr -s ' ' <"$b/device/model" | sed 's/^ //; s/ $//')
    case "$model" in
    "Amazon EC2 NVMe Instance Storage" | "Microsoft NVMe Direct Disk"* | "nvme_card")
      basename "$b"
      return 0
      ;;
    esac
  done
  return 1
}

# zeros DEV OFFSET_MIB: the MiB at OFFSET_MIB reads as zeros.
zeros() {
  [ "$(dd if="$1" bs=1M skip="$2" count=1 status=none | tr -d '\0' | wc -c)" = 0 ]
}

mounted_at() { # the mount point of device $1, if mounted
  awk -v d="$1" '$1 == d {print $2; exit}' /proc/self/mounts
}

if ! mountpoint -q "$MNT"; then
  if ! name=$(instance_store); then
    log "no instance-store NVMe: Docker stays on the boot disk"
    exit 0
  fi
  dev="$DEV/$name"
  real=$(readlink -f "$dev")
  if [ -n "$(mounted_at "$real")" ] || compgen -G "$SYS/block/$name/${name}p*" >/dev/null ||
    [ -n "$(ls -A "$SYS/block/$name/holders" 2>/dev/null)" ]; then
    log "$dev is partitioned, mounted or held (RAID, LVM): not touched"
    exit 0
  fi
  fs=$(blkid -p -s TYPE -o value "$dev" 2>/dev/null || true)
  label=$(blkid -p -s LABEL -o value "$dev" 2>/dev/null || true)
  if [ -n "$fs" ] && [ "$label" != "$LABEL" ]; then
    log "$dev holds a $fs filesystem (label '${label}') this script did not make: not touched"
    exit 0
  fi
  if [ -z "$fs" ]; then
    size_mib=$(($(blockdev --getsize64 "$dev") / 1048576))
    if ! zeros "$dev" 0 || ! zeros "$dev" $((size_mib - 1)); then
      log "$dev has no filesystem blkid knows but is not blank: not formatted"
      exit 0
    fi
    log "formatting the blank instance store $dev (ext4, label $LABEL)"
    mkfs.ext4 -q -L "$LABEL" -E nodiscard -m 0 "$dev"
  fi
  mkdir -p "$MNT"
  mount -o noatime "$dev" "$MNT"
  log "$dev mounted on $MNT"
fi

mkdir -p "$want"
# Images baked into the image (prepull_images) are on the boot disk: the
# first boot copies them over, with Docker stopped.
if [ -z "$(ls -A "$want")" ] && [ -d "$DEFAULT_ROOT" ] && [ -n "$(ls -A "$DEFAULT_ROOT" 2>/dev/null)" ]; then
  running=
  if systemctl is-active --quiet docker.service; then
    running=1
    systemctl stop docker.socket docker.service
  fi
  log "copying $DEFAULT_ROOT to $want"
  cp -a "$DEFAULT_ROOT/." "$want/"
  [ -z "$running" ] || systemctl start docker.service
fi
mkdir -p "$(dirname "$DAEMON_JSON")"
if [ "$(json_get data-root)" != "$want" ]; then
  json_set data-root "$want"
  log "Docker's data root is $want"
  if systemctl is-active --quiet docker.service; then
    systemctl restart docker.service
  fi
fi
TANDEM_EOF
chmod 0755 "/usr/local/lib/tandem/docker-data-root.sh"
mkdir -p "/etc/systemd/system"
cat > "/etc/systemd/system/tandem-docker-data-root.service" <<'TANDEM_EOF'
[Unit]
Description=Tandem: Docker's data root on the instance-store NVMe
Documentation=https://github.com/tandem-run/tandem
After=local-fs.target
Before=docker.service containerd.service dstack-shim.service
ConditionPathExists=/usr/local/lib/tandem/docker-data-root.sh

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/local/lib/tandem/docker-data-root.sh

[Install]
WantedBy=multi-user.target
TANDEM_EOF
chmod 0644 "/etc/systemd/system/tandem-docker-data-root.service"
mkdir -p /root/.ssh && chmod 700 /root/.ssh
grep -qxF 'ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGa6ZRd7ZG7JXqZbWbKJ3b7h5pI6kY0cUQYvV0c8m1pF user@laptop' /root/.ssh/authorized_keys 2>/dev/null || echo 'ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGa6ZRd7ZG7JXqZbWbKJ3b7h5pI6kY0cUQYvV0c8m1pF user@laptop' >> /root/.ssh/authorized_keys
chmod 600 /root/.ssh/authorized_keys
/usr/local/lib/tandem/install-agents.sh
