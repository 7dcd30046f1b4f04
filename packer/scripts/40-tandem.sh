#!/bin/bash
# Tandem's agents and the dstack-shim service, from /tmp/tandem (uploaded by
# Packer). The unit is the same one tandem cloudinit writes. Idempotent.
set -euo pipefail
src=/tmp/tandem
install -m 0755 "$src/dstack-shim" /usr/local/bin/dstack-shim
install -m 0755 "$src/dstack-runner" /usr/local/bin/dstack-runner
/usr/local/bin/dstack-shim --version
/usr/local/bin/dstack-runner --version
install -d -m 0755 /etc/dstack /root/.dstack
install -m 0600 "$src/shim.env" /etc/dstack/shim.env
install -m 0644 "$src/dstack-shim.service" /etc/systemd/system/dstack-shim.service
systemctl daemon-reload
systemctl enable dstack-shim.service
