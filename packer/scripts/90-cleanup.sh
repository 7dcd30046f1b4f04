#!/bin/bash
# Leave a clean image: no caches, no instance identity, no build leftovers.
set -euo pipefail
apt-get clean
rm -rf /var/lib/apt/lists/* /tmp/tandem
if command -v cloud-init >/dev/null; then
  cloud-init clean --logs
fi
rm -f /etc/ssh/ssh_host_*
truncate -s 0 /etc/machine-id
rm -f /root/.bash_history /home/*/.bash_history
