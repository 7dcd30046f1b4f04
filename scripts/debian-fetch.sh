#!/bin/bash
# Fetches Debian packages of SUITE with apt's own client, through a private
# source list and state (the machine's apt lists and cache stay as they
# are), and unpacks them into ROOT with dpkg -x: nothing is installed.
# Prints each package's name and version. Used by gpu-kit.sh and by the
# CDI tests (e2e/testenv.CDIDocker).
#
#   scripts/debian-fetch.sh SUITE ROOT PACKAGE...
set -euo pipefail
usage() { echo "usage: debian-fetch.sh SUITE ROOT PACKAGE..." >&2; exit 2; }
[ $# -ge 3 ] || usage
suite=$1 root=$2
shift 2
tmp=$(mktemp -d /tmp/debian-fetch.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial" "$tmp/debs" "$root"
echo "deb http://deb.debian.org/debian $suite main" >"$tmp/sources.list"
apt=(-o "Dir::Etc::SourceList=$tmp/sources.list" -o Dir::Etc::SourceParts=/dev/null
	-o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache" -o APT::Sandbox::User=root)
apt-get "${apt[@]}" update -qq
(cd "$tmp/debs" && apt-get "${apt[@]}" download -qq "$@")
for d in "$tmp"/debs/*.deb; do
	dpkg -x "$d" "$root"
	echo "$(dpkg-deb -f "$d" Package) $(dpkg-deb -f "$d" Version)"
done
