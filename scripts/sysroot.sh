#!/bin/sh
# Prints the path of a Debian 11 (bullseye, glibc 2.31) amd64 root, made
# once with debootstrap and cached: the release links dstack-shim (cgo, for
# NVML) against it, so that the shim starts on glibc 2.31 or newer (Ubuntu
# 20.04, Debian 11) instead of needing the build machine's glibc. The root
# also runs programs (chroot), which is how the tests check the result.
#
#   scripts/sysroot.sh [dir]   (default: $TANDEM_SYSROOT or
#                               /var/cache/tandem/sysroot-bullseye-amd64)
# Env: TANDEM_DEBIAN_MIRROR (default http://deb.debian.org/debian).
set -eu
root="${1:-${TANDEM_SYSROOT:-/var/cache/tandem/sysroot-bullseye-amd64}}"
mirror="${TANDEM_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
if [ ! -f "$root/.tandem-sysroot" ]; then
	rm -rf "$root.tmp"
	mkdir -p "$(dirname "$root")"
	echo "sysroot: debootstrap bullseye with libc6-dev into $root (one-time)" >&2
	debootstrap --variant=minbase --include=libc6-dev bullseye "$root.tmp" "$mirror" >"$root.log" 2>&1 || {
		tail -n 20 "$root.log" >&2
		echo "sysroot: debootstrap failed" >&2
		exit 1
	}
	# The linker follows symlinks on this machine, not in the root: an
	# absolute one (libpthread.so -> /lib/...) would reach this machine's
	# newer glibc. Relative links work both ways.
	find -H "$root.tmp/usr/lib/x86_64-linux-gnu" "$root.tmp/lib64" -maxdepth 1 -type l -lname '/*' | while read -r l; do
		ln -sfn "$(realpath -m --relative-to="$(dirname "$l")" "$root.tmp$(readlink "$l")")" "$l"
	done
	touch "$root.tmp/.tandem-sysroot"
	rm -rf "$root"
	mv "$root.tmp" "$root"
fi
echo "$root"
