#!/bin/sh
# Proves the README's set-up promise: in a clean container of each distro
# (debootstrap minbase, no Go, no Docker; only make is installed first),
# `make demo` on a fresh clone installs what it needs and prints "job done".
# The container shares the host's Docker socket and /tmp (a nested
# privileged dockerd is not possible in every sandbox; the demo's shim must
# see the same paths the daemon binds) and, for TLS to the module proxy,
# the host's CA certificates. Needs root, Docker, debootstrap and network
# access to the distros' archives and the module proxy. Usage:
#   scripts/fresh-check.sh [bookworm|jammy|noble ...]   (default: all three)
set -eu
cd "$(dirname "$0")/.."
cache=/var/cache/tandem-fresh
mkdir -p "$cache"
src=$(mktemp -d /tmp/tandem-fresh-XXXXXX)
trap 'rm -rf "$src"' EXIT
git clone -q . "$src/repo"
fail=0
for rel in "${@:-bookworm jammy noble}"; do
	for r in $rel; do
		case "$r" in
		bookworm) mirror=http://deb.debian.org/debian; script=bookworm ;;
		jammy | noble) mirror=http://archive.ubuntu.com/ubuntu; script=gutsy ;;
		*) echo "fresh-check: unknown release $r" >&2; exit 2 ;;
		esac
		image="tandem-fresh/$r:minbase"
		if ! docker image inspect "$image" >/dev/null 2>&1; then
			root="$cache/rootfs-$r"
			rm -rf "$root"
			debootstrap --variant=minbase --components=main,universe "$r" "$root" "$mirror" "/usr/share/debootstrap/scripts/$script" >"$cache/debootstrap-$r.log" 2>&1
			tar -C "$root" -c . | docker import - "$image" >/dev/null
			rm -rf "$root"
		fi
		rm -rf "$src/repo/bin"
		start=$(date +%s)
		out="$src/$r.log"
		if docker run --rm --network host -v /var/run/docker.sock:/var/run/docker.sock -v /tmp:/tmp \
			-v /etc/ssl/certs:/hostcerts:ro -e SSL_CERT_DIR=/hostcerts "$image" sh -c "
				set -e; export DEBIAN_FRONTEND=noninteractive
				if command -v go || command -v docker; then echo 'not a fresh image'; exit 1; fi
				apt-get update -qq && apt-get install -y -qq make >/dev/null
				cd $src/repo && make demo" >"$out" 2>&1 && grep -q '^job done$' "$out"; then
			echo "fresh-check: $r: make demo printed \"job done\" in $(($(date +%s) - start)) s"
		else
			echo "fresh-check: $r: FAILED; last lines:" >&2
			tail -n 20 "$out" >&2
			fail=1
		fi
	done
done
exit "$fail"
