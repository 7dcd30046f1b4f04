#!/bin/sh
# Builds the release tree dstack's server can install from:
#
#   <out>/<version>/binaries/dstack-shim-linux-{amd64,arm64}    (cgo: NVML)
#   <out>/<version>/binaries/dstack-runner-linux-{amd64,arm64}  (static)
#   <out>/<version>/binaries/tandem-{linux,darwin}-{amd64,arm64}
#   <out>/<version>/binaries/SHA256SUMS
#   <out>/<version>/version     "<version>": a DSTACK_*_VERSION_URL target
#   <out>/latest-version        the same, for the newest release built here
#
# <version> is the dstack release the agents report (see common/version);
# TANDEM_VERSION is ours. Builds are reproducible: -trimpath, no VCS stamp,
# an empty build id and fixed flags, so the same sources give the same sums.
#
# usage: scripts/release.sh <version> [out]   (env: TANDEM_VERSION, CHECK=1
# builds everything a second time with an empty Go cache and compares sums)
set -eu
cd "$(dirname "$0")/.."
version="${1:?usage: release.sh <dstack version x.y.z> [out]}"
out="${2:-dist}"
tandem="${TANDEM_VERSION:-0.1.0}"
case "$version" in
*[!0-9.]* | .* | *. | *..*) echo "release: version $version is not x.y.z" >&2; exit 2 ;;
esac
[ "$(echo "$version" | tr -cd . | wc -c)" -eq 2 ] || { echo "release: version $version is not x.y.z" >&2; exit 2; }
pkg=github.com/tandem-run/tandem
ldflags="-s -w -buildid= -X $pkg/common/version.dstack=$version -X $pkg/common/version.tandem=$tandem"
export CGO_CFLAGS="-O2 -Wno-deprecated-declarations"
# urfave/cli's man page and markdown writers (and their markdown parser) are
# never used: 0.3 MB less in each binary.
tags=urfave_cli_no_docs

build() { # dir goos goarch cgo cc name package [cgo ldflags]
	CGO_ENABLED="$4" CC="$5" CGO_LDFLAGS="${8:-}" GOOS="$2" GOARCH="$3" \
		go build -trimpath -buildvcs=false -tags "$tags" -ldflags "$ldflags" -o "$1/$6" "$7"
}

# The amd64 shim is linked against Debian 11's glibc 2.31 (scripts/sysroot.sh)
# so that it starts on Ubuntu 20.04 / Debian 11 and newer. libpthread and
# libdl are named: before glibc 2.34 they were not part of libc.
sysroot=$(./scripts/sysroot.sh)
cc231="gcc --sysroot=$sysroot -B$sysroot/usr/lib/x86_64-linux-gnu/ -L$sysroot/usr/lib/x86_64-linux-gnu"

build_all() { # dir
	mkdir -p "$1"
	build "$1" linux amd64 1 "$cc231" dstack-shim-linux-amd64 ./cmd/dstack-shim "-Wl,--no-as-needed -lpthread -ldl"
	build "$1" linux arm64 1 aarch64-linux-gnu-gcc dstack-shim-linux-arm64 ./cmd/dstack-shim
	for arch in amd64 arm64; do
		build "$1" linux "$arch" 0 "" "dstack-runner-linux-$arch" ./cmd/dstack-runner
		for os in linux darwin; do
			build "$1" "$os" "$arch" 0 "" "tandem-$os-$arch" ./cmd/tandem
		done
	done
	(cd "$1" && sha256sum dstack-* tandem-* >SHA256SUMS)
}

command -v aarch64-linux-gnu-gcc >/dev/null || { echo "release: aarch64-linux-gnu-gcc missing (make deps installs gcc-aarch64-linux-gnu)" >&2; exit 1; }
bin="$out/$version/binaries"
rm -rf "$bin"
build_all "$bin"
echo "$version" >"$out/$version/version"
echo "$version" >"$out/latest-version"

if [ "${CHECK:-}" = 1 ]; then
	again=$(mktemp -d)
	cache=$(mktemp -d)
	GOCACHE="$cache" build_all "$again/binaries"
	if cmp "$bin/SHA256SUMS" "$again/binaries/SHA256SUMS"; then
		echo "release: reproducible: a second build with an empty Go cache gave the same sums" >&2
	else
		diff "$bin/SHA256SUMS" "$again/binaries/SHA256SUMS" >&2 || true
		rm -rf "$again" "$cache"
		exit 1
	fi
	rm -rf "$again" "$cache"
fi
(cd "$bin" && ls -l) >&2
