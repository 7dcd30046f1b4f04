#!/bin/bash
# Names the machine a `make bench` ran on, for the figures table of docs/figures.md
# (internal/benchtable reads the "machine:" line). TANDEM_BENCH_MACHINE
# names it in words (default: its hostname).
set -u
name=${TANDEM_BENCH_MACHINE:-$(hostname)}
cpu=$(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo 2>/dev/null)
mem=$(awk '/^MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo 2>/dev/null)
docker=$(docker version --format '{{.Server.Version}}' 2>/dev/null || echo none)
gpu=none
if command -v nvidia-smi >/dev/null 2>&1; then
	gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | awk '{$1=$1" x"; print}' | paste -sd, -)
fi
# One process start (fork + exec of true, the median of 5 rounds of 100):
# what every container start is made of, so two tables can be compared. A
# VM whose page-table work is slow starts processes, and so containers, at
# several times another's pace with the same CPU figures.
spawn=$(for _ in 1 2 3 4 5; do
	s=$(date +%s%N)
	for _ in $(seq 100); do /bin/true; done
	echo $((($(date +%s%N) - s) / 100000))
done | sort -n | sed -n 3p)
echo "machine: ${name}: ${cpu:-unknown CPU}, $(nproc) cores, ${mem:-? GiB}, Linux $(uname -r), Docker ${docker}, GPU ${gpu:-none}, process start ${spawn} µs"
