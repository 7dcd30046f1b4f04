#!/bin/bash
# Packs what `make gpu-smoke` needs on a GPU machine that has an NVIDIA
# driver and nothing else (no Go, no Docker, no container toolkit, no
# network) into one file, OUT/kit.tar.xz:
#
#   bin/     Docker from Debian's archive (DOCKER_SUITE, trixie: Docker 26,
#            which takes CDI device requests), its containerd, runc and
#            init, and NVIDIA's container toolkit (nvidia-ctk,
#            nvidia-container-runtime, nvidia-cdi-hook) built from its Go
#            module at NCT_VERSION
#   tandem/  dstack-shim, dstack-runner, tandem and gpu.test (shim/gpu's
#            tests, for the real-NVML ones), built here
#
#   scripts/gpu-kit.sh BIN OUT
#
# The GPU machine unpacks it with `make gpu-smoke GPU_KIT=OUT/kit.tar.xz`.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:?usage: gpu-kit.sh BIN OUT}
out=${2:?usage: gpu-kit.sh BIN OUT}
suite=${DOCKER_SUITE:-trixie}
nct=${NCT_VERSION:-v1.20.2}
tmp=$(mktemp -d /tmp/gpu-kit.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/kit/bin/lib" "$tmp/kit/tandem" "$out"

# Docker, containerd, runc and tini from Debian's archive.
./scripts/debian-fetch.sh "$suite" "$tmp/root" docker.io containerd runc tini libseccomp2
cp "$tmp/root/usr/sbin/dockerd" "$tmp/root/usr/bin/containerd" "$tmp/root/usr/bin/containerd-shim-runc-v2" \
	"$tmp/root/usr/sbin/runc" "$tmp/root/usr/sbin/docker-proxy" "$tmp/kit/bin/"
cp "$tmp/root/usr/bin/tini-static" "$tmp/kit/bin/docker-init"
cp -L "$tmp"/root/usr/lib/x86_64-linux-gnu/libseccomp.so.2 "$tmp/kit/bin/lib/"

# NVIDIA's container toolkit, from its Go module (cgo: NVML is dlopened).
GOBIN="$tmp/kit/bin" CGO_CFLAGS="${CGO_CFLAGS:-} -Wno-deprecated-declarations" go install -trimpath \
	-ldflags "-s -w -X github.com/NVIDIA/nvidia-container-toolkit/internal/info.version=${nct#v}" \
	"github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-ctk@$nct" \
	"github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-container-runtime@$nct" \
	"github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-cdi-hook@$nct"
echo "nvidia-container-toolkit: $("$tmp/kit/bin/nvidia-ctk" --version | head -1)"

# Ours.
cp "$bin/dstack-shim" "$bin/dstack-runner" "$bin/tandem" "$tmp/kit/tandem/"
go test -c -trimpath -ldflags '-s -w' -o "$tmp/kit/tandem/gpu.test" ./shim/gpu

# One xz stream with a dictionary that spans the binaries: dockerd,
# containerd and the shim share much of their code.
(cd "$tmp/kit" && tar -cf - bin/dockerd bin/containerd bin/containerd-shim-runc-v2 bin/runc \
	bin/nvidia-ctk bin/nvidia-container-runtime bin/nvidia-cdi-hook tandem bin/docker-init bin/docker-proxy bin/lib) |
	xz -T1 --lzma2=preset=9,dict=256MiB >"$out/kit.tar.xz.tmp"
mv "$out/kit.tar.xz.tmp" "$out/kit.tar.xz"
ls -la "$out/kit.tar.xz"
