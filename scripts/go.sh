#!/bin/sh
# Makes the Go toolchain this module needs available as /usr/local/go/bin/go
# on a fresh Debian/Ubuntu machine (as root), only when no Go that new is
# on the PATH. Distribution Go is too old to build the module (Debian 12 has
# 1.19, Ubuntu 22.04 1.18) and older than 1.21 cannot fetch toolchains
# itself, so it is only the bootstrap: it downloads the toolchain module
# (golang.org/toolchain) through the module proxy, which checks it against
# the checksum database, and the toolchain is copied out of the module
# cache.
set -eu
cd "$(dirname "$0")/.."

log() { printf 'go: %s\n' "$*" >&2; }

# The version: GO_VERSION, else go.mod's toolchain line, else its go line.
want="${GO_VERSION:-}"
if [ -z "$want" ]; then
	want=$(sed -n 's/^toolchain go\([0-9.]*\)$/\1/p' go.mod)
fi
if [ -z "$want" ]; then
	want=$(sed -n 's/^go \([0-9.]*\)$/\1/p' go.mod)
fi
[ -n "$want" ] || { log "no go version in go.mod"; exit 1; }

# newer A B: A >= B, comparing dotted versions.
newer() {
	[ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n1)" = "$2" ]
}

for g in go /usr/local/go/bin/go; do
	if have=$(GOTOOLCHAIN=local "$g" env GOVERSION 2>/dev/null); then
		have=${have#go}
		if newer "$have" "$want"; then
			exit 0
		fi
	fi
done

if [ "$(id -u)" -ne 0 ]; then
	log "Go $want is needed (found none that new); run as root to install it, or install it yourself"
	exit 1
fi

case "$(uname -m)" in
x86_64) arch=amd64 ;;
aarch64 | arm64) arch=arm64 ;;
*) log "no Go toolchain for $(uname -m)"; exit 1 ;;
esac

if ! command -v go >/dev/null 2>&1; then
	log "installing the distribution's Go, to bootstrap Go $want"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends golang-go ca-certificates >/dev/null
fi

mod="golang.org/toolchain@v0.0.1-go$want.linux-$arch"
tmp=$(mktemp -d)
trap 'chmod -R u+w "$tmp" 2>/dev/null; rm -rf "$tmp"' EXIT
log "downloading $mod through ${GOPROXY:-the module proxy}"
# Outside any module; the bootstrap's own toolchain, its own cache.
dir=$(cd "$tmp" && GOTOOLCHAIN=local GO111MODULE=on GOFLAGS=-modcacherw GOPATH="$tmp/gopath" \
	go mod download -json "$mod" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
if [ -z "$dir" ] || [ ! -f "$dir/bin/go" ]; then
	log "the toolchain module has no bin/go"
	exit 1
fi
rm -rf /usr/local/go.new
cp -R "$dir" /usr/local/go.new
# Module zips carry no file modes: the programs are made executable again.
chmod -R u+w,a+rX /usr/local/go.new
chmod a+x /usr/local/go.new/bin/* /usr/local/go.new/pkg/tool/*/*
rm -rf /usr/local/go
mv /usr/local/go.new /usr/local/go
log "installed $(/usr/local/go/bin/go version) in /usr/local/go"
