#!/bin/bash
# Images the image's users run, pulled at build time (PREPULL_IMAGES,
# space-separated references): present on first boot, so the first job on
# a fresh host does not wait for a multi-GB pull. PREPULL_AUTH (JSON:
# {"registry": {"username": ..., "password": ...}}) logs in for the pulls
# and out after, so no credential stays in the image; registries in
# PREPULL_INSECURE_REGISTRIES (host:port) are reached over plain HTTP for
# the build only. Idempotent.
set -euo pipefail
if [ -z "${PREPULL_IMAGES:-}" ]; then
  echo "prepull: no images"
  exit 0
fi
daemon=/etc/docker/daemon.json
insecure=${PREPULL_INSECURE_REGISTRIES:-}
if [ -n "$insecure" ]; then
  cp "$daemon" "$daemon.prepull"
  # shellcheck disable=SC2086 # one argument per registry
  jq --args '. + {"insecure-registries": $ARGS.positional}' $insecure <"$daemon.prepull" >"$daemon"
  systemctl restart docker
fi
logins=()
while IFS=$'\t' read -r registry user password; do
  [ -n "$registry" ] || continue
  printf '%s' "$password" | docker login --username "$user" --password-stdin "$registry" >/dev/null
  logins+=("$registry")
done < <(jq -r 'to_entries[] | [.key, .value.username, .value.password] | @tsv' <<<"${PREPULL_AUTH:-"{}"}")
for image in $PREPULL_IMAGES; do
  echo "prepull: $image"
  docker pull -q "$image"
done
for registry in "${logins[@]}"; do
  docker logout "$registry" >/dev/null
done
if [ -n "$insecure" ]; then
  mv "$daemon.prepull" "$daemon"
  systemctl restart docker
fi
# The shim's image GC never removes what the image was built with (the
# unit's optional second EnvironmentFile; urfave/cli splits on commas).
mkdir -p /etc/dstack
# shellcheck disable=SC2086 # one word per image
printf 'TANDEM_SHIM_IMAGE_GC_KEEP=%s\n' "$(printf '%s,' $PREPULL_IMAGES | sed 's/,$//')" >/etc/dstack/prepulled.env
# What the image carries, for the build log.
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}'
