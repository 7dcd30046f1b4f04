#!/bin/sh
# After the test suite: no process the suite started may still be running.
# Test daemons run with their config under a test temp dir (/tmp/Test*,
# /tmp/tandem-*), so a survivor is recognisable by its command line.
set -eu
left=$(pgrep -af 'git daemon --reuseaddr|docker-registry serve /tmp/|sshd -D -e -f /tmp/|dstack-shim --shim-home /tmp/|dockerd --host unix:///tmp/tandem-dockerd-|containerd-shim.* -address /tmp/tandem-dockerd-' || true)
if [ -n "$left" ]; then
	echo "leftovers: processes started by the test suite are still running:" >&2
	echo "$left" >&2
	exit 1
fi
# Nor a mount under a test's temp dir (a test dockerd's netns or root, a
# volume test's loop mount): a killed run leaves them behind and they pin
# the disk.
mounts=$(awk '$2 ~ "^/tmp/(tandem-|Test)" {print $2}' /proc/self/mounts || true)
if [ -n "$mounts" ]; then
	echo "leftovers: mounts under test temp dirs are still there (umount -l each):" >&2
	echo "$mounts" >&2
	exit 1
fi
# Nor a cold registry's network namespace, veth, or Docker trust of its CA
# (testenv.NewNetns, StartColdRegistry): each would pin an address and a
# certs.d entry per run.
netns=$(ip netns list 2>/dev/null | awk '$1 ~ /^tandem-ns-/ {print $1}' || true)
veths=$(ip -o link show 2>/dev/null | awk -F': ' '$2 ~ /^tcr[0-9a-f]+[hn](@|$)/ {print $2}' || true)
certs=$(ls -d /etc/docker/certs.d/10.213.* 2>/dev/null || true)
if [ -n "$netns$veths$certs" ]; then
	echo "leftovers: cold registry namespaces, veths or certs.d entries are still there (ip netns del, ip link del, rm -r each):" >&2
	printf '%s\n' "$netns" "$veths" "$certs" | sed '/^$/d' >&2
	exit 1
fi
# Nor an image pulled from a test's registry (testenv.RemoveImagesFrom):
# each run would leave one more in the engine.
if command -v docker >/dev/null 2>&1; then
	images=$(docker images --format '{{.Repository}}:{{.Tag}}' 2>/dev/null | grep -E '^(127\.0\.0\.1|10\.213\.[0-9]+\.2):[0-9]+/' || true)
	if [ -n "$images" ]; then
		echo "leftovers: images pulled from test registries are still there (docker rmi each):" >&2
		echo "$images" >&2
		exit 1
	fi
fi
echo "leftovers: none" >&2
