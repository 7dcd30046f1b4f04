#!/bin/bash
# Provisioning starts only once the base image's cloud-init is done: SSH
# answers while its final stage still runs (apt, users, keys), and the
# steps below would race it. A base whose cloud-init failed fails the build.
set -euo pipefail
if ! command -v cloud-init >/dev/null; then
  echo "no cloud-init in this image: nothing to wait for"
  exit 0
fi
rc=0
out=$(cloud-init status --long --wait 2>&1) || rc=$?
echo "$out"
case "$rc" in
0) ;;
2) echo "cloud-init finished with recoverable errors (above); going on" >&2 ;;
*) echo "the base image's cloud-init failed (above): fix the base image or its seed" >&2; exit 1 ;;
esac
