#!/bin/bash
# Base packages, kernel tuning and no background upgrades, for GPU job
# hosts (both flavours). Idempotent.
set -euo pipefail
# Error-Mode=any: a list that cannot be fetched (no DNS, a dead mirror)
# fails the build instead of installing from stale lists.
apt-get -o APT::Update::Error-Mode=any update -qq
# pigz: Docker unpacks each pulled layer with unpigz (every core) when it
# is installed, with one core of gzip otherwise.
apt-get install -y -qq --no-install-recommends ca-certificates curl gnupg jq ufw pigz

# Nothing upgrades packages behind the operator's back: a background driver
# upgrade leaves NVML at "Driver/library version mismatch" and every GPU
# job failing until a reboot. The periodic apt jobs are off (their timers
# masked, and APT::Periodic off for anything that runs apt's daily
# script); upgrades come with a new image.
systemctl disable apt-daily.timer apt-daily-upgrade.timer >/dev/null 2>&1 || true
systemctl mask apt-daily.timer apt-daily-upgrade.timer apt-daily.service apt-daily-upgrade.service
mkdir -p /etc/apt/apt.conf.d /etc/sysctl.d
cat > /etc/apt/apt.conf.d/99-tandem-no-periodic <<'CONF'
// Tandem: no background apt runs (see packer/scripts/10-base.sh).
APT::Periodic::Enable "0";
APT::Periodic::Update-Package-Lists "0";
APT::Periodic::Download-Upgradeable-Packages "0";
APT::Periodic::Unattended-Upgrade "0";
CONF

# Each value against dstack's kernel-tuning.sh: docs/operator-guide.md "Kernel tuning".
cat > /etc/sysctl.d/90-tandem.conf <<'CONF'
# Tandem: many containers, big models, busy networks.
fs.inotify.max_user_watches = 1048576
fs.inotify.max_user_instances = 8192
fs.file-max = 2097152
vm.max_map_count = 1048576
# Swap only to avoid an OOM kill (dstack: 0, which can OOM-kill a cgroup
# that still had page cache to give back on hosts with swap).
vm.swappiness = 1
net.core.somaxconn = 4096
net.ipv4.tcp_max_syn_backlog = 8192
net.ipv4.ip_forward = 1
# Socket buffers for 100-400 Gb/s NICs (dstack: 16 MiB, under one stream's
# bandwidth-delay product at those rates).
net.core.rmem_max = 67108864
net.core.wmem_max = 67108864
net.ipv4.tcp_rmem = 4096 131072 67108864
net.ipv4.tcp_wmem = 4096 65536 67108864
# net.ipv4.ip_local_port_range stays the kernel's 32768-60999: dstack's
# "3500 4000" leaves 500 ephemeral ports (EADDRNOTAVAIL under NCCL, pip or
# a data loader's connections) and takes ports services bind.
CONF
sysctl --system >/dev/null
