#!/bin/bash
# NVIDIA flavour: driver, nvidia-container-toolkit with a CDI spec that is
# regenerated at every boot (drivers change), persistenced (saves 2-3 s per
# container start). A no-op for the cpu flavour. Idempotent.
set -euo pipefail
if [ "${FLAVOR:-cpu}" != "nvidia" ]; then
  echo "flavor ${FLAVOR:-cpu}: no NVIDIA stack"
  exit 0
fi
: "${NVIDIA_DRIVER_VERSION:?set NVIDIA_DRIVER_VERSION}"
if [ "${OS:-ubuntu}" != "ubuntu" ]; then
  echo "flavor nvidia: the driver packages (nvidia-driver-N-server) are Ubuntu's; build the nvidia flavor with os=ubuntu" >&2
  exit 1
fi
apt-get install -y -qq --no-install-recommends "nvidia-driver-${NVIDIA_DRIVER_VERSION}-server" "nvidia-utils-${NVIDIA_DRIVER_VERSION}-server"

keyring=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg
if [ ! -f "$keyring" ]; then
  curl -fsSL https://nvidia.github.io/libnvidia-container/gpgkey | gpg --dearmor -o "$keyring"
fi
curl -fsSL https://nvidia.github.io/libnvidia-container/stable/deb/nvidia-container-toolkit.list \
  | sed "s#deb https://#deb [signed-by=${keyring}] https://#g" > /etc/apt/sources.list.d/nvidia-container-toolkit.list
apt-get -o APT::Update::Error-Mode=any update -qq
apt-get install -y -qq --no-install-recommends nvidia-container-toolkit
nvidia-ctk runtime configure --runtime=docker

mkdir -p /etc/cdi
cat > /etc/systemd/system/nvidia-cdi-refresh.service <<'UNIT'
[Unit]
Description=Regenerate the NVIDIA CDI spec for the installed driver
After=systemd-modules-load.service
Before=docker.service dstack-shim.service

[Service]
Type=oneshot
ExecStart=/usr/bin/nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml

[Install]
WantedBy=multi-user.target
UNIT
systemctl enable nvidia-cdi-refresh.service
systemctl enable nvidia-persistenced.service || true
systemctl restart docker
