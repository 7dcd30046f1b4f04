#!/bin/sh
# Runs every Go fuzz target in the module for FUZZTIME each (default 60s).
# Targets are found, not listed: a new Fuzz function is fuzzed without a
# Makefile change. A found crasher (written to testdata/fuzz) fails the run.
# Go's fuzz coordinator sometimes ends a clean run with "context deadline
# exceeded" while stopping its workers (no input is reported): that run is
# retried (twice at most), anything else is a failure.
set -eu
cd "$(dirname "$0")/.."
FUZZTIME="${FUZZTIME:-60s}"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
grep -rl --include='*_test.go' '^func Fuzz' . | sort | while read -r file; do
	pkg="./$(dirname "${file#./}")"
	grep -o '^func Fuzz[A-Za-z0-9_]*' "$file" | sed 's/^func //' | while read -r target; do
		for attempt in 1 2 3; do
			printf 'fuzz: %s %s for %s\n' "$pkg" "$target" "$FUZZTIME" >&2
			if go test -run '^$' -fuzz "^${target}\$" -fuzztime "$FUZZTIME" "$pkg" >"$out" 2>&1; then
				tail -n 1 "$out"
				break
			fi
			cat "$out"
			if [ "$attempt" -lt 3 ] && grep -q 'context deadline exceeded' "$out" && ! grep -q 'Failing input written' "$out"; then
				echo "fuzz: $target: the coordinator's shutdown timed out (no failing input); retrying" >&2
				continue
			fi
			exit 1
		done
	done
done
