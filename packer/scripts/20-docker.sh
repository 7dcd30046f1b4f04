#!/bin/bash
# Docker with live-restore (the daemon can restart under running jobs) and
# rotated logs. Idempotent.
set -euo pipefail
apt-get install -y -qq --no-install-recommends docker.io
mkdir -p /etc/docker
if [ -f /etc/docker/daemon.json ]; then
  current=$(cat /etc/docker/daemon.json)
else
  current='{}'
fi
echo "$current" | jq '. + {"live-restore": true, "log-driver": "json-file", "log-opts": {"max-size": "100m", "max-file": "3"}}' > /etc/docker/daemon.json.new
mv /etc/docker/daemon.json.new /etc/docker/daemon.json
systemctl enable docker
systemctl restart docker
