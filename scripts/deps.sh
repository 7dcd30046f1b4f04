#!/bin/sh
# Installs what Tandem's build and tests need on Debian/Ubuntu (as root), only
# what is missing, and makes sure a Docker daemon answers. `deps.sh demo`
# installs only what `make demo` needs (Docker, a C compiler for the shim's
# NVML binding, busybox for the demo image, Go when none here builds the
# module: into a directory of its own, see scripts/go.sh).
set -eu
cd "$(dirname "$0")/.."

# pigz: Docker unpacks a pulled layer with unpigz when it is on the PATH
# (several cores instead of Go's one), as our images and cloud-init set up
# hosts. nftables: the cold registry's link shaping (e2e/testenv/netns.go).
DEMO_PACKAGES="docker.io busybox-static gcc libc6-dev ca-certificates pigz"
PACKAGES="$DEMO_PACKAGES nftables docker-registry openssh-client openssh-server rsync git fdisk cloud-init packer debootstrap shellcheck apache2-utils e2fsprogs util-linux iproute2 sudo gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static systemd prometheus jq qemu-system-x86 qemu-utils genisoimage xorriso socat"
STATICCHECK_VERSION="${STATICCHECK_VERSION:-v0.8.2}"

log() { printf 'deps: %s\n' "$*" >&2; }

mode="${1:-all}"
if [ "$mode" = demo ]; then
	PACKAGES="$DEMO_PACKAGES"
fi

missing=""
for p in $PACKAGES; do
	if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
		missing="$missing $p"
	fi
done
if [ -n "$missing" ]; then
	if [ "$(id -u)" -ne 0 ]; then
		log "missing packages:$missing (run as root to install them)"
		exit 1
	fi
	log "installing:$missing"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	# shellcheck disable=SC2086 # word splitting of the package list is intended
	apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

# A Go already here that builds the module, else one fetched into a
# directory of its own (scripts/go.sh): no installed Go is replaced.
godir=$(./scripts/go.sh)
PATH="$godir:$PATH"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
gobin="$(go env GOPATH)/bin"
if [ "$mode" != demo ] && ! command -v staticcheck >/dev/null 2>&1 && [ ! -x "$gobin/staticcheck" ]; then
	log "installing staticcheck $STATICCHECK_VERSION"
	go install "honnef.co/go/tools/cmd/staticcheck@$STATICCHECK_VERSION"
fi

if ! docker info >/dev/null 2>&1; then
	if [ "$(id -u)" -ne 0 ]; then
		log "docker daemon is not answering and we are not root to start it"
		exit 1
	fi
	log "starting dockerd"
	mkdir -p /var/log
	nohup dockerd >/var/log/tandem-dockerd.log 2>&1 &
	i=0
	until docker info >/dev/null 2>&1; do
		i=$((i + 1))
		if [ "$i" -ge 60 ]; then
			log "dockerd did not answer within 60s; last log lines:"
			tail -n 20 /var/log/tandem-dockerd.log >&2 || true
			exit 1
		fi
		sleep 1
	done
fi
log "ready: $(docker version --format 'docker server {{.Server.Version}}')"
