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
