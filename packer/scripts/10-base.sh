#!/bin/bash
# Base packages and kernel tuning for GPU job hosts. Idempotent.
set -euo pipefail
# Error-Mode=any: a list that cannot be fetched (no DNS, a dead mirror)
# fails the build instead of installing from stale lists.
apt-get -o APT::Update::Error-Mode=any update -qq
apt-get install -y -qq --no-install-recommends ca-certificates curl gnupg jq ufw
cat > /etc/sysctl.d/90-tandem.conf <<'CONF'
# Tandem: many containers, big models, busy networks.
fs.inotify.max_user_watches = 1048576
fs.inotify.max_user_instances = 8192
fs.file-max = 2097152
vm.max_map_count = 1048576
net.core.somaxconn = 4096
net.ipv4.ip_forward = 1
net.ipv4.tcp_max_syn_backlog = 8192
CONF
sysctl --system >/dev/null
