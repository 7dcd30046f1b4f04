#!/bin/sh
# After the test suite: no process the suite started may still be running.
# Test daemons run with their config under a test temp dir (/tmp/Test*,
# /tmp/tandem-*), so a survivor is recognisable by its command line.
set -eu
left=$(pgrep -af 'git daemon --reuseaddr|docker-registry serve /tmp/|sshd -D -e -f /tmp/|dstack-shim --shim-home /tmp/|dockerd --host unix:///tmp/tandem-dockerd-' || true)
if [ -n "$left" ]; then
	echo "leftovers: processes started by the test suite are still running:" >&2
	echo "$left" >&2
	exit 1
fi
echo "leftovers: none" >&2
