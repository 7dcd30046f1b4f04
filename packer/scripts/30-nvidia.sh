#!/bin/bash
# NVIDIA flavour: the driver of NVIDIA_DRIVER_VERSION from Ubuntu's archive
# (server branch; NVIDIA_KERNEL_MODULES=open, required for Blackwell and
# NVIDIA's choice from Turing on, or proprietary, for Volta and older),
# Fabric Manager of the same version (CUDA does not initialise on NVSwitch
# systems, HGX 8-GPU, without it: error 802; where there is no NVSwitch
# the service is skipped, not failed), persistenced (saves 2-3 s per
# container start), the container toolkit with a CDI spec regenerated at
# every boot; and every package of the driver's version held, so that
# nothing upgrades the libraries under a loaded kernel module ("Driver/
# library version mismatch"). A no-op for the cpu flavour. Idempotent.
set -euo pipefail
if [ "${FLAVOR:-cpu}" != "nvidia" ]; then
  echo "flavor ${FLAVOR:-cpu}: no NVIDIA stack"
  exit 0
fi
: "${NVIDIA_DRIVER_VERSION:?set NVIDIA_DRIVER_VERSION}"
v=$NVIDIA_DRIVER_VERSION
modules=${NVIDIA_KERNEL_MODULES:-open}
if [ "${OS:-ubuntu}" != "ubuntu" ]; then
  echo "flavor nvidia: the driver packages (nvidia-driver-N-server) are Ubuntu's; build the nvidia flavor with os=ubuntu" >&2
  exit 1
fi
case "$v" in
*[!0-9]* | "") echo "NVIDIA_DRIVER_VERSION must be a driver branch number (e.g. 550, 570), not '$v'" >&2; exit 1 ;;
esac
case "$modules" in
open) driver="nvidia-driver-${v}-server-open" ;;
proprietary) driver="nvidia-driver-${v}-server" ;;
*) echo "NVIDIA_KERNEL_MODULES must be open or proprietary, not '$modules'" >&2; exit 1 ;;
esac
apt-get install -y -qq --no-install-recommends "$driver" "nvidia-utils-${v}-server"
# The branch really installed: Ubuntu turns a retired branch into a
# transitional package of a newer one (in 2026 nvidia-driver-550-server
# and -570-server install 580), and Fabric Manager must be the driver's
# exact version, so it is pinned to what the driver's libraries are.
mapfile -t compute < <(dpkg-query -W -f '${db:Status-Abbrev} ${Package} ${Version}\n' 'libnvidia-compute-*-server' 2>/dev/null |
  awk '$1 == "ii" {print $2, $3}')
if [ "${#compute[@]}" -ne 1 ]; then
  echo "expected one installed libnvidia-compute-N-server after installing $driver, found ${#compute[@]}: ${compute[*]:-none}" >&2
  exit 1
fi
read -r pkg exact <<<"${compute[0]}"
branch=${pkg#libnvidia-compute-}
branch=${branch%-server}
if [ "$branch" != "$v" ]; then
  echo "driver branch ${v} is packaged as ${branch} in this archive (transitional): Fabric Manager ${branch}" >&2
fi
apt-get install -y -qq --no-install-recommends "nvidia-fabricmanager-${branch}=${exact}" "libnvidia-nscq-${branch}=${exact}"
echo "NVIDIA driver ${exact} (${modules} modules), Fabric Manager ${exact}"

keyring=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg
if [ ! -f "$keyring" ]; then
  curl -fsSL https://nvidia.github.io/libnvidia-container/gpgkey | gpg --dearmor -o "$keyring"
fi
curl -fsSL https://nvidia.github.io/libnvidia-container/stable/deb/nvidia-container-toolkit.list \
  | sed "s#deb https://#deb [signed-by=${keyring}] https://#g" > /etc/apt/sources.list.d/nvidia-container-toolkit.list
apt-get -o APT::Update::Error-Mode=any update -qq
apt-get install -y -qq --no-install-recommends nvidia-container-toolkit
nvidia-ctk runtime configure --runtime=docker

mkdir -p /etc/cdi /etc/systemd/system
cat > /etc/systemd/system/nvidia-cdi-refresh.service <<'UNIT'
[Unit]
Description=Regenerate the NVIDIA CDI spec for the installed driver
After=systemd-modules-load.service
Before=docker.service dstack-shim.service

[Service]
Type=oneshot
# The shim asks for GPUs by UUID: name them so whatever the toolkit's default.
ExecStart=/usr/bin/nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml --device-name-strategy=index --device-name-strategy=uuid

[Install]
WantedBy=multi-user.target
UNIT

# Fabric Manager runs where there are NVSwitches (PCI class 0x0680,
# vendor NVIDIA); elsewhere it is skipped by its condition.
install -d -m 0755 /usr/local/lib/tandem /etc/systemd/system/nvidia-fabricmanager.service.d
cat > /usr/local/lib/tandem/has-nvswitch <<'SH'
#!/bin/sh
# Exit 0 when the host has an NVIDIA NVSwitch (a Fabric Manager to run).
for d in "${TANDEM_SYS:-/sys}"/bus/pci/devices/*; do
  [ "$(cat "$d/vendor" 2>/dev/null)" = 0x10de ] || continue
  case "$(cat "$d/class" 2>/dev/null)" in 0x0680*) exit 0 ;; esac
done
exit 1
SH
chmod 0755 /usr/local/lib/tandem/has-nvswitch
cat > /etc/systemd/system/nvidia-fabricmanager.service.d/tandem.conf <<'UNIT'
[Service]
ExecCondition=/usr/local/lib/tandem/has-nvswitch
UNIT
systemctl daemon-reload
systemctl enable nvidia-cdi-refresh.service nvidia-persistenced.service nvidia-fabricmanager.service

# Hold every installed package of this driver branch (the metapackage,
# a transitional one, its libraries, kernel modules and Fabric Manager): a held package is not
# upgraded, and its dependencies cannot be moved under it.
mapfile -t held < <(dpkg-query -W -f '${Package}\n' |
  grep -E "^(nvidia|libnvidia|linux-modules-nvidia|linux-objects-nvidia|linux-signatures-nvidia|xserver-xorg-video-nvidia)-" |
  grep -E -- "-(${v}|${branch})(-|$)" | sort -u)
if [ "${#held[@]}" -eq 0 ]; then
  echo "no package of driver ${branch} is installed to hold" >&2
  exit 1
fi
apt-mark hold "${held[@]}"
systemctl restart docker
