#!/bin/sh
# Finds a Go that can build this module and prints its bin directory on
# stdout. A Go already on the machine is used when it is new enough for
# go.mod's go line: `go` on the PATH, then /usr/local/go's, then the one
# this script fetched before. Only when none is, it fetches the toolchain
# go.mod names (its toolchain line, else its go line) into a directory of
# its own, ${TANDEM_GO_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem/go<version>},
# never over a Go the machine has (/usr/local/go is left as it is).
#
# The toolchain is the golang.org/toolchain module, downloaded through the
# module proxy, which checks it against the checksum database, with a Go
# at least 1.21 (older ones cannot fetch toolchains); a machine with no Go
# at all gets the distribution's golang-go for that (Debian 12 has 1.19,
# Ubuntu 22.04 1.18: too old to build the module itself, not to fetch).
#
#   scripts/go.sh          the directory; fetches the toolchain if needed
#   scripts/go.sh --find   the directory, or exit 1: never fetches
#
# TANDEM_SYSTEM_GO names the system's Go to look at (default
# /usr/local/go/bin/go; the tests point it elsewhere).
set -eu
cd "$(dirname "$0")/.."

log() { printf 'go: %s\n' "$*" >&2; }

find_only=false
case "${1:-}" in
--find) find_only=true ;;
"") ;;
*) log "usage: $0 [--find]"; exit 2 ;;
esac

# need: the oldest Go that builds the module (go.mod's go line); fetch: the
# version fetched when none is at hand (GO_VERSION, else the toolchain
# line, else the go line).
need=$(sed -n 's/^go \([0-9][0-9.]*\)$/\1/p' go.mod)
[ -n "$need" ] || { log "no go line in go.mod"; exit 1; }
fetch="${GO_VERSION:-}"
if [ -z "$fetch" ]; then
	fetch=$(sed -n 's/^toolchain go\([0-9][0-9.]*\)$/\1/p' go.mod)
fi
fetch="${fetch:-$need}"
cache="${XDG_CACHE_HOME:-${HOME:-/root}/.cache}"
private="${TANDEM_GO_DIR:-$cache/tandem/go$fetch}"
system="${TANDEM_SYSTEM_GO:-/usr/local/go/bin/go}"

# newer A B: A >= B, comparing dotted versions.
newer() {
	[ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n1)" = "$2" ]
}

# version G: the Go release G is (without "go"), as itself (never a
# toolchain it would switch to), or nothing.
version() {
	v=$(GOTOOLCHAIN=local "$1" env GOVERSION 2>/dev/null) || return 0
	v=${v#go}
	case "$v" in
	[0-9]*) printf '%s\n' "${v%%[!0-9.]*}" ;;
	esac
}

onpath=$(command -v go 2>/dev/null || true)
for g in "$onpath" "$system" "$private/bin/go"; do
	if [ -z "$g" ] || [ ! -x "$g" ]; then continue; fi
	have=$(version "$g")
	if [ -n "$have" ] && newer "$have" "$need"; then
		# Its own directory (a distribution's /usr/bin/go is a link into
		# /usr/lib/go-*/bin), so that a PATH it is put first on gains
		# nothing else.
		real=$(readlink -f "$g" 2>/dev/null || printf '%s\n' "$g")
		dirname "$real"
		exit 0
	fi
	[ -z "$have" ] || log "$g is Go $have; this module needs $need or newer"
done

if $find_only; then
	log "no Go $need or newer here (go on the PATH, $system, $private); scripts/go.sh fetches Go $fetch into $private"
	exit 1
fi

case "$(uname -m)" in
x86_64) arch=amd64 ;;
aarch64 | arm64) arch=arm64 ;;
*) log "no Go toolchain for $(uname -m)"; exit 1 ;;
esac

# The bootstrap: a Go that can download modules by itself (1.21 or newer
# reads the toolchain module; any 1.13 or newer downloads it).
boot=""
for g in "$onpath" "$system"; do
	if [ -z "$g" ] || [ ! -x "$g" ]; then continue; fi
	if [ -n "$(version "$g")" ]; then
		boot=$g
		break
	fi
done
if [ -z "$boot" ]; then
	if [ "$(id -u)" -ne 0 ]; then
		log "Go $need or newer is needed and there is no Go here to fetch it with: install one (or run as root: the distribution's golang-go is installed for it)"
		exit 1
	fi
	log "installing the distribution's Go, to fetch Go $fetch with"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends golang-go ca-certificates >/dev/null
	boot=$(command -v go)
fi

mod="golang.org/toolchain@v0.0.1-go$fetch.linux-$arch"
tmp=$(mktemp -d)
trap 'chmod -R u+w "$tmp" 2>/dev/null; rm -rf "$tmp"' EXIT
log "fetching $mod through ${GOPROXY:-the module proxy} into $private"
# Outside any module; the bootstrap's own toolchain, its own cache.
dir=$(cd "$tmp" && GOTOOLCHAIN=local GO111MODULE=on GOFLAGS=-modcacherw GOPATH="$tmp/gopath" \
	"$boot" mod download -json "$mod" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
if [ -z "$dir" ] || [ ! -f "$dir/bin/go" ]; then
	log "the toolchain module has no bin/go"
	exit 1
fi
mkdir -p "$(dirname "$private")"
rm -rf "$private.new"
cp -R "$dir" "$private.new"
# Module zips carry no file modes: the programs are made executable again.
chmod -R u+w,a+rX "$private.new"
chmod a+x "$private.new"/bin/* "$private.new"/pkg/tool/*/*
rm -rf "$private"
mv "$private.new" "$private"
log "installed $("$private/bin/go" version) in $private (remove that directory to remove it)"
printf '%s\n' "$private/bin"
