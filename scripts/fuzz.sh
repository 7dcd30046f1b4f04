#!/bin/sh
# Runs every Go fuzz target in the module for FUZZTIME each (default 60s).
# Targets are found, not listed: a new Fuzz function is fuzzed without a
# Makefile change. Any failure stops the run with go test's exit status.
set -eu
cd "$(dirname "$0")/.."
FUZZTIME="${FUZZTIME:-60s}"
grep -rl --include='*_test.go' '^func Fuzz' . | sort | while read -r file; do
	pkg="./$(dirname "${file#./}")"
	grep -o '^func Fuzz[A-Za-z0-9_]*' "$file" | sed 's/^func //' | while read -r target; do
		printf 'fuzz: %s %s for %s\n' "$pkg" "$target" "$FUZZTIME" >&2
		go test -run '^$' -fuzz "^${target}\$" -fuzztime "$FUZZTIME" "$pkg"
	done
done
