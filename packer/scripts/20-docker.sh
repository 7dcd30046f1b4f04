#!/bin/bash
# Docker with live-restore (the daemon can restart under running jobs),
# rotated logs, 8 layer downloads at once, and its data root on the
# instance-store NVMe when a host has one (at every boot, before Docker:
# tandem-docker-data-root.service, the same files tandem cloudinit
# writes). Idempotent.
set -euo pipefail
apt-get install -y -qq --no-install-recommends docker.io
mkdir -p /etc/docker
if [ -f /etc/docker/daemon.json ]; then
  current=$(cat /etc/docker/daemon.json)
else
  current='{}'
fi
# max-concurrent-downloads: more layers of a pull at once than Docker's
# default 3 (a value already in daemon.json is kept).
echo "$current" | jq '{"max-concurrent-downloads": 8} + . + {"live-restore": true, "log-driver": "json-file", "log-opts": {"max-size": "100m", "max-file": "3"}}' > /etc/docker/daemon.json.new
mv /etc/docker/daemon.json.new /etc/docker/daemon.json
install -d -m 0755 /usr/local/lib/tandem /etc/systemd/system
install -m 0755 /tmp/tandem/docker-data-root.sh /usr/local/lib/tandem/docker-data-root.sh
install -m 0644 /tmp/tandem/tandem-docker-data-root.service /etc/systemd/system/tandem-docker-data-root.service
systemctl daemon-reload
systemctl enable tandem-docker-data-root.service
systemctl enable docker
systemctl restart docker
