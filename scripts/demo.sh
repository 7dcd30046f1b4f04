#!/bin/sh
# The main job: one run through both agents on this machine. Builds a tiny
# local image, starts dstack-shim with a temporary home, runs a job with
# `tandem run` that reports the machine's CPUs, memory and GPUs, streams it,
# and cleans everything up. The ports it binds, said as it starts: the
# shim's API (DEMO_SHIM_PORT, on 127.0.0.1), and while the job runs its
# runner's, on the host network: its HTTP API (DEMO_RUNNER_PORT, on
# 127.0.0.1) and its SSH server (DEMO_RUNNER_SSH_PORT, every interface, key
# login only: tandem ssh's way in).
set -eu
cd "$(dirname "$0")/.."
SHIM_PORT="${DEMO_SHIM_PORT:-20998}"
RUNNER_PORT="${DEMO_RUNNER_PORT:-20999}"
RUNNER_SSH_PORT="${DEMO_RUNNER_SSH_PORT:-20022}"
IMAGE=tandem-demo/busybox:1

if ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
	ctx=$(mktemp -d)
	cp "$(command -v busybox || echo /bin/busybox)" "$ctx/busybox"
	printf 'root:x:0:0:root:/root:/bin/sh\n' >"$ctx/passwd"
	printf 'root:x:0:\n' >"$ctx/group"
	cat >"$ctx/Dockerfile" <<'DOCKERFILE'
FROM scratch
COPY busybox /bin/busybox
RUN ["/bin/busybox", "--install", "-s", "/bin"]
COPY passwd group /etc/
RUN mkdir -p /root /tmp && chmod 1777 /tmp
ENV PATH=/usr/local/bin:/usr/bin:/bin
DOCKERFILE
	if ! docker build -q -t "$IMAGE" "$ctx" >/dev/null 2>"$ctx/build.err"; then
		cat "$ctx/build.err" >&2
		exit 1
	fi
	rm -rf "$ctx"
fi

home=$(mktemp -d)
bin/dstack-shim --shim-home "$home" --shim-http-port "$SHIM_PORT" \
	--runner-binary-path "$PWD/bin/dstack-runner" --runner-http-port "$RUNNER_PORT" --runner-ssh-port "$RUNNER_SSH_PORT" \
	>"$home/shim.out" 2>&1 &
shim_pid=$!
cleanup() {
	kill "$shim_pid" 2>/dev/null || true
	wait "$shim_pid" 2>/dev/null || true
	# The machine as found: no task container of this demo's shim stays
	# (an interrupted run's included).
	for c in $(docker ps -aq --filter "label=run.tandem.shim.home=$home" 2>/dev/null); do
		docker rm -f "$c" >/dev/null 2>&1 || true
	done
	# Runner dirs are filesystems of their own, mounted until their task is
	# removed: detach what an interrupted run left, then remove the home.
	awk -v p="$home/" 'index($5, p) == 1 {print $5}' /proc/self/mountinfo | sort -r | while read -r m; do umount -l "$m" || true; done
	rm -rf "$home"
}
trap cleanup EXIT INT TERM

i=0
until bin/tandem info --shim "127.0.0.1:$SHIM_PORT" >/dev/null 2>&1; do
	i=$((i + 1))
	if [ "$i" -ge 50 ]; then
		echo "demo: the shim did not start:" >&2
		cat "$home/shim.out" >&2
		exit 1
	fi
	sleep 0.1
done
echo "demo: ports: dstack-shim's API on 127.0.0.1:$SHIM_PORT; while the job runs, its runner's HTTP API on 127.0.0.1:$RUNNER_PORT and its SSH server (tandem ssh; key login only) on port $RUNNER_SSH_PORT of every interface; all closed when the demo ends"
bin/tandem info --shim "127.0.0.1:$SHIM_PORT"
echo
# shellcheck disable=SC2016 # expanded inside the job, not here
bin/tandem run --rm --shim "127.0.0.1:$SHIM_PORT" --runner-port "$RUNNER_PORT" --image "$IMAGE" --no-ssh-config --env GREETING=hello -- \
	/bin/sh -c '
echo "$GREETING from $(hostname) in $DSTACK_WORKING_DIR (run $DSTACK_RUN_NAME)"
echo "CPUs:   $(nproc)"
echo "Memory: $(free -m | awk "/Mem:/ {print \$2}") MiB"
if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi -L; else echo "GPUs:   none visible to this job"; fi
for i in 1 2 3 4 5; do printf "\rprogress %d/5" "$i"; sleep 0.2; done
echo
echo done'
