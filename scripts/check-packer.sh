#!/bin/sh
# Checks the Packer templates the way CI can: formatting, and a full
# validate (no cloud credentials needed) against placeholder binaries and
# a throwaway qemu key, so it works before `make build` too.
set -eu
cd "$(dirname "$0")/../packer"
packer fmt -check .
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
touch "$tmp/dstack-shim" "$tmp/dstack-runner"
ssh-keygen -q -t ed25519 -N '' -f "$tmp/key"
# Every os and flavour the template builds.
for combo in "ubuntu 22.04 cpu" "ubuntu 22.04 nvidia" "ubuntu 24.04 cpu" "ubuntu 24.04 nvidia" "debian 12 cpu"; do
	# shellcheck disable=SC2086 # three words
	set -- $combo
	echo "packer validate: os=$1 os_version=$2 flavor=$3" >&2
	packer validate -var "os=$1" -var "os_version=$2" -var "flavor=$3" -var "bin_dir=$tmp" -var "qemu_ssh_key=$tmp/key" .
done
packer validate -var flavor=nvidia -var nvidia_kernel_modules=proprietary -var 'prepull_images=["nvcr.io/nvidia/pytorch:25.01-py3"]' \
	-var "bin_dir=$tmp" -var "qemu_ssh_key=$tmp/key" .
# A bad variable is refused before any build.
for bad in flavor=gpu nvidia_kernel_modules=closed; do
	if packer validate -var "$bad" -var "bin_dir=$tmp" -var "qemu_ssh_key=$tmp/key" . >/dev/null 2>&1; then
		echo "check-packer: -var $bad was accepted" >&2
		exit 1
	fi
done
