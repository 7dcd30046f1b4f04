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
packer validate -var "bin_dir=$tmp" -var "qemu_ssh_key=$tmp/key" .
packer validate -var os=debian -var os_version=12 -var "bin_dir=$tmp" -var "qemu_ssh_key=$tmp/key" .
packer validate -var os=ubuntu -var os_version=24.04 -var "bin_dir=$tmp" -var "qemu_ssh_key=$tmp/key" .
