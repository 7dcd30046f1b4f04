#!/bin/bash
# GPU smoke test for a machine with an NVIDIA driver: the real-NVML tests,
# then a real dstack-shim discovers the GPUs through NVML and runs a CUDA
# job through `tandem run --gpus 1`, in an image that carries no driver
# library: what the job needs of the driver is what the container toolkit
# puts there.
#
#   scripts/gpu-smoke.sh [DOCKER_BUNDLE]
#   GPU_KIT=.gpu-kit/kit.tar.xz scripts/gpu-smoke.sh
#
# With a Docker daemon running (and nvidia-container-toolkit set up, as
# the Packer image does), that daemon is used as it is, in one pass.
#
# Without one, the Docker binaries come from DOCKER_BUNDLE (a directory of
# dockerd, containerd, containerd-shim-runc-v2, runc, docker-init and lib/)
# or from GPU_KIT (`make gpu-kit` packs it: Docker 26, NVIDIA's container
# toolkit, our binaries and shim/gpu's test binary, for a machine with
# neither Go nor Docker). dockerd is started with a private root. When the
# toolkit is in the bundle, the job runs twice, through the toolkit's two
# ways into a container, both in CDI mode, with a CDI spec that nvidia-ctk
# generates here:
#   cdi      Docker's own CDI device requests (features.cdi): the shim asks
#            for nvidia.com/gpu=<UUID>;
#   runtime  nvidia-container-runtime in mode "cdi" as Docker's default
#            runtime: the shim asks for the GPU as dstack does (the NVIDIA
#            device request) and the runtime turns NVIDIA_VISIBLE_DEVICES
#            into the CDI devices, dropping Docker's legacy hook.
# Without the toolkit, a stand-in: a pass-through hook and a runtime
# wrapper that maps the GPUs named in NVIDIA_VISIBLE_DEVICES (only those),
# with an image that carries the driver's user-space libraries.
#
# Prints PASS or FAIL lines and exits non-zero on any failure.
set -u
cd "$(dirname "$0")/.." || exit 1
work=$(mktemp -d /tmp/gpu-smoke.XXXXXX)
pids=()
fail=0
# shellcheck disable=SC2317 # called by the trap
cleanup() {
	for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null; done
	sleep 1
	for p in "${pids[@]}"; do kill -KILL -- "-$p" 2>/dev/null; done
}
trap cleanup EXIT
check() { # check NAME CMD...: runs CMD, PASS/FAIL
	if "${@:2}"; then echo "PASS $1"; else echo "FAIL $1"; fail=1; fi
}
secs() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 2))" "$@"; }

nvidia-smi -L || { echo "FAIL no NVIDIA driver (nvidia-smi)"; exit 1; }
smi_name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
smi_list=$(nvidia-smi -L)
smi_count=$(wc -l <<<"$smi_list")
echo "driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)"

# 0. Our binaries and the real-NVML tests: built here with Go, or the kit's.
tbin=bin
bundle=${1:-}
if [ -n "${GPU_KIT:-}" ]; then
	mkdir -p "$work/kit"
	if command -v xz >/dev/null; then
		tar -C "$work/kit" -xJf "$GPU_KIT"
	else
		python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$GPU_KIT" "$work/kit"
	fi || { echo "FAIL unpack $GPU_KIT"; exit 1; }
	tbin=$work/kit/tandem
	bundle=$work/kit/bin
	check "real-NVML tests (shim/gpu)" sh -c "cd shim/gpu && '$tbin/gpu.test' -test.count 1 -test.v -test.run RealNVML"
elif command -v go >/dev/null; then
	check "real-NVML tests (shim/gpu)" go test -count 1 -v -run RealNVML ./shim/gpu
else
	echo "note: no Go and no GPU_KIT: the real-NVML tests do not run"
fi

# 1. The CUDA program: a vector add checked on the host side; it prints
#    the UUID of the device it ran on. Built static against cudart, so an
#    image needs only libc and what the toolkit mounts (libcuda).
cat >"$work/smoke.cu" <<'CU'
#include <cstdio>
#include <cuda_runtime.h>
__global__ void add(const float *a, const float *b, float *c, size_t n) {
	size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
	if (i < n) c[i] = a[i] + b[i];
}
int main() {
	int n = 0;
	cudaError_t derr = cudaGetDeviceCount(&n);
	if (derr != cudaSuccess || n == 0) { printf("no CUDA device (%s)\n", cudaGetErrorString(derr)); return 2; }
	cudaDeviceProp p; cudaGetDeviceProperties(&p, 0);
	const unsigned char *u = (const unsigned char *)p.uuid.bytes;
	printf("CUDA device 0 of %d: GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x\n", n,
		u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
	const size_t N = 64u << 20; // 64 Mi floats: 256 MiB per array
	float *a, *b, *c;
	cudaMalloc(&a, N * 4); cudaMalloc(&b, N * 4); cudaMalloc(&c, N * 4);
	float *h = (float *)malloc(N * 4);
	for (size_t i = 0; i < N; i++) h[i] = (float)(i % 1000);
	cudaMemcpy(a, h, N * 4, cudaMemcpyHostToDevice);
	cudaMemcpy(b, h, N * 4, cudaMemcpyHostToDevice);
	cudaEvent_t s, e; cudaEventCreate(&s); cudaEventCreate(&e);
	add<<<(N + 255) / 256, 256>>>(a, b, c, N);
	cudaEventRecord(s);
	for (int r = 0; r < 20; r++) add<<<(N + 255) / 256, 256>>>(a, b, c, N);
	cudaEventRecord(e); cudaEventSynchronize(e);
	float ms; cudaEventElapsedTime(&ms, s, e);
	cudaError_t err = cudaGetLastError();
	if (err != cudaSuccess) { printf("CUDA error %s\n", cudaGetErrorString(err)); return 4; }
	cudaMemcpy(h, c, N * 4, cudaMemcpyDeviceToHost);
	for (size_t i = 0; i < N; i++) if (h[i] != 2.0f * (float)(i % 1000)) { printf("mismatch at %zu\n", i); return 3; }
	printf("CUDA OK: %s, %d SMs, %zu MiB, vector add of %zu floats verified, %.0f GB/s\n", p.name, p.multiProcessorCount,
		p.totalGlobalMem >> 20, N, 20.0 * 3 * N * 4 / (ms / 1000) / 1e9);
	return 0;
}
CU
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
nvcc -O2 -cudart static -gencode "arch=compute_$cc,code=sm_$cc" -o "$work/cuda-smoke" "$work/smoke.cu" || { echo "FAIL nvcc"; exit 1; }
echo "on the host: $("$work/cuda-smoke" | tail -1)"

# image NAME WITH_DRIVER: a rootfs of sh, cuda-smoke and the libraries they
# load; WITH_DRIVER adds nvidia-smi and the driver's libcuda and NVML (for
# the stand-in, which mounts nothing).
image() {
	local root="$work/rootfs-$1" f
	mkdir -p "$root/bin" "$root/lib64" "$root/etc" "$root/tmp" "$root/root" "$root/workflow"
	chmod 1777 "$root/tmp"
	cp "$work/cuda-smoke" "$root/bin/"
	cp -L /bin/sh "$root/bin/sh"
	local extra=()
	if [ "$2" = 1 ]; then
		cp "$(command -v nvidia-smi)" "$root/bin/"
		extra=("$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')" "$(ldconfig -p | awk '/libnvidia-ml.so.1 /{print $NF; exit}')")
		cp -L "${extra[0]}" "$root/lib64/libcuda.so.1"
		cp -L "${extra[1]}" "$root/lib64/libnvidia-ml.so.1"
	fi
	for f in "$root/bin/"* "${extra[@]}"; do
		ldd "$f" 2>/dev/null | awk '/=>/ {print $3} /ld-linux/ {print $1}'
	done | sort -u | while read -r l; do [ -f "$l" ] && cp -L "$l" "$root/lib64/"; done
	mkdir -p "$root/lib/x86_64-linux-gnu"
	ln -sf /lib64/ld-linux-x86-64.so.2 "$root/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
	printf 'root:x:0:0:root:/root:/bin/sh\n' >"$root/etc/passwd"
	printf 'root:x:0:\n' >"$root/etc/group"
	printf '/lib64\n' >"$root/etc/ld.so.conf"
	tar -C "$root" -cf "$work/rootfs-$1.tar" .
	curl -sf --unix-socket "$sock" -X POST -H 'Content-Type: application/x-tar' --data-binary "@$work/rootfs-$1.tar" \
		"http://d/images/create?fromSrc=-&repo=tandem-cuda-smoke&tag=$1&changes=ENV%20PATH%3D%2Fbin&changes=ENV%20LD_LIBRARY_PATH%3D%2Flib64" >/dev/null ||
		{ echo "FAIL image import"; return 1; }
	echo "image tandem-cuda-smoke:$1: $(du -sh "$work/rootfs-$1.tar" | cut -f1)$([ "$2" = 1 ] && echo ", with the driver's libraries")"
}

export DOCKER_HOST=unix:///var/run/docker.sock
sock=/var/run/docker.sock
dockerd_pid=

# dockerd_start MODE: dockerd from the bundle with MODE's daemon.json.
dockerd_start() {
	local mode=$1 path="$bundle"
	mkdir -p "$work/docker" /var/run "$work/hookbin"
	case $mode in
	cdi) printf '{"experimental": true, "features": {"cdi": true}, "cdi-spec-dirs": ["%s"]}\n' "$work/cdi" >"$work/daemon-$mode.json" ;;
	runtime)
		printf '{"runtimes": {"nvidia": {"path": "%s"}}, "default-runtime": "nvidia"}\n' "$work/bin/nvidia-runtime-smoke" >"$work/daemon-$mode.json"
		path="$work/hookbin:$path"
		;;
	standin)
		printf '{"runtimes": {"smoke": {"path": "%s"}}, "default-runtime": "smoke"}\n' "$work/bin/smoke-runc" >"$work/daemon-$mode.json"
		path="$work/hookbin:$path"
		;;
	esac
	PATH="$path:$PATH" LD_LIBRARY_PATH="$bundle/lib" setsid dockerd --data-root "$work/docker" \
		--exec-root "$work/exec" --pidfile "$work/dockerd.pid" --host "unix://$sock" --config-file "$work/daemon-$mode.json" \
		--iptables=false --ip6tables=false --bridge=none >"$work/dockerd-$mode.log" 2>&1 </dev/null &
	dockerd_pid=$!
	pids+=("$dockerd_pid")
	for _ in $(seq 100); do curl -sf --unix-socket "$sock" http://d/_ping >/dev/null 2>&1 && break; sleep 0.2; done
	curl -sf --unix-socket "$sock" http://d/_ping >/dev/null || { echo "FAIL dockerd did not start"; tail -30 "$work/dockerd-$mode.log"; return 1; }
	echo "dockerd $(curl -s --unix-socket "$sock" http://d/version | python3 -c 'import json,sys; print(json.load(sys.stdin)["Version"])') started ($mode)"
}

dockerd_stop() {
	[ -n "$dockerd_pid" ] || return 0
	kill -TERM -- "-$dockerd_pid" 2>/dev/null
	for _ in $(seq 100); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.1; done
	kill -KILL -- "-$dockerd_pid" 2>/dev/null
	dockerd_pid=
	rm -f "$sock"
}

# smoke MODE IMAGE WANT_VIA: a shim with real NVML on this Docker, and the
# checks; WANT_VIA is how the shim must say it reaches the GPUs.
smoke() {
	local mode=$1 img=$2 via=$3 home="$work/shim-$1" out rc start end n alloc bg bgrc shim
	echo "=== $mode"
	mkdir -p "$home"
	setsid "$tbin/dstack-shim" --shim-home "$home" --shim-http-port 20998 --service \
		--runner-binary-path "$tbin/dstack-runner" --runner-http-port 20999 --runner-ssh-port 20022 \
		>"$work/shim-$mode.log" 2>&1 </dev/null &
	shim=$!
	pids+=("$shim")
	for _ in $(seq 100); do "$tbin/tandem" info --shim 127.0.0.1:20998 >/dev/null 2>&1 && break; sleep 0.1; done
	for _ in $(seq 50); do [ -s "$home/host_info.json" ] && break; sleep 0.1; done
	local info
	info=$(cat "$home/host_info.json" 2>/dev/null)
	echo "host_info.json: $info"
	check "[$mode] host_info.json reports the GPUs nvidia-smi sees ($smi_count x $smi_name)" grep -q "\"gpu_name\":\"$smi_name\".*\"gpu_count\":$smi_count," <<<"$info"
	run() { "$tbin/tandem" run --shim 127.0.0.1:20998 --runner-port 20999 --image "tandem-cuda-smoke:$img" "$@"; }
	start=$(date +%s.%N)
	out=$(run --gpus 1 -- /bin/sh -c 'nvidia-smi -L 2>&1 | head -1; cuda-smoke' 2>&1)
	rc=$?
	end=$(date +%s.%N)
	echo "$out"
	echo "[$mode] tandem run --gpus 1: exit $rc in $(secs "$start" "$end") s"
	check "[$mode] the shim reaches the GPUs via $via" grep -q "NVIDIA GPUs reached via $via" "$work/shim-$mode.log"
	if [ "$via" = cdi ]; then
		check "[$mode] the shim finds every GPU named in the CDI spec" grep -q "CDI specs name every GPU" "$work/shim-$mode.log"
	fi
	check "[$mode] CUDA job exits 0" test "$rc" = 0
	check "[$mode] CUDA job verified its vector add on the GPU" grep -q "CUDA OK" <<<"$out"
	local uuid
	uuid=$(sed -n 's/^CUDA device 0 of 1: \(GPU-[0-9a-f-]*\)$/\1/p' <<<"$out")
	check "[$mode] the job sees exactly one GPU, one nvidia-smi lists (${uuid:-none})" grep -q "UUID: ${uuid:-none})" <<<"$smi_list"
	if [ "$mode" = runtime ]; then
		check "[$mode] Docker's legacy hook never ran (the runtime dropped it for CDI)" test ! -e "$work/legacy-hook.ran"
		check "[$mode] nvidia-container-runtime injected the GPU as a CDI device" grep -q "Creating CDI modifier for devices: \\[nvidia.com/gpu=${uuid:-none}\\]" "$work/nvidia-runtime.log"
	fi
	n=$smi_count
	out=$(run --gpus $((n + 1)) -- /bin/sh -c true 2>&1)
	rc=$?
	echo "[$mode] tandem run --gpus $((n + 1)): exit $rc: $(tail -2 <<<"$out")"
	check "[$mode] asking for more GPUs than the host has is refused" test "$rc" != 0
	# While one task holds the GPU, a second GPU task is refused and the
	# metrics count it allocated; once the first ends, the GPU is free
	# again. (the image has no sleep: dash counts instead, a few seconds)
	# shellcheck disable=SC2016 # expanded by the job's shell
	run --gpus 1 -- /bin/sh -c 'cuda-smoke && i=0 && while [ $i -lt 3000000 ]; do i=$((i+1)); done' >"$work/bg.out" 2>&1 &
	bg=$!
	for _ in $(seq 50); do grep -q 'CUDA OK' "$work/bg.out" && break; sleep 0.2; done
	alloc=$(curl -s http://127.0.0.1:20998/metrics | awk '/^tandem_shim_gpus\{state="allocated"\}/ {print $2}')
	check "[$mode] the running GPU task shows in the metrics (allocated=$alloc)" test "$alloc" = 1
	out=$(run --gpus 1 -- /bin/sh -c true 2>&1)
	echo "[$mode] second --gpus 1 while the first runs: $(tail -1 <<<"$out")"
	check "[$mode] a second GPU task is refused while the GPU is held" grep -q "no capacity" <<<"$out"
	wait "$bg"
	bgrc=$?
	check "[$mode] the first GPU task ran to its end (exit $bgrc)" test "$bgrc" = 0
	alloc=$(curl -s http://127.0.0.1:20998/metrics | awk '/^tandem_shim_gpus\{state="allocated"\}/ {print $2}')
	check "[$mode] the GPU is free again (allocated=$alloc)" test "$alloc" = 0
	out=$(run --gpus 0 -- /bin/sh -c '[ -e /dev/nvidia0 ] && echo /dev/nvidia0 is visible; cuda-smoke' 2>&1)
	echo "$out"
	check "[$mode] a job with --gpus 0 sees no GPU" grep -q "no CUDA device" <<<"$out"
	curl -s http://127.0.0.1:20998/metrics | grep -E '^tandem_shim_(gpus|tasks)' | head -8
	if [ "$fail" != 0 ]; then
		echo "--- shim log ($mode)"; tail -40 "$work/shim-$mode.log"
		[ -f "$work/smoke-runc.err" ] && { echo "--- runtime wrapper"; cat "$work/smoke-runc.err"; }
		[ -f "$work/nvidia-runtime.log" ] && { echo "--- nvidia-container-runtime log"; tail -20 "$work/nvidia-runtime.log"; }
		[ -f "$work/dockerd-$mode.log" ] && { echo "--- dockerd log"; tail -10 "$work/dockerd-$mode.log"; }
	fi
	kill -TERM -- "-$shim" 2>/dev/null
	for _ in $(seq 50); do kill -0 "$shim" 2>/dev/null || break; sleep 0.1; done
}

# 2. Docker as it is, or from the bundle in each of its modes.
if curl -sf --unix-socket "$sock" http://d/_ping >/dev/null 2>&1; then
	echo "using the running Docker daemon"
	image 1 0 || exit 1
	via=hook
	[ "$(curl -s --unix-socket "$sock" http://d/info | python3 -c 'import json,sys; i=json.load(sys.stdin); print("hook" if "nvidia" in (i.get("Runtimes") or {}) else "cdi" if i.get("CDISpecDirs") else "")')" = cdi ] && via=cdi
	smoke docker 1 "$via"
	exit "$fail"
fi
[ -n "$bundle" ] || { echo "FAIL no Docker daemon running, and neither DOCKER_BUNDLE nor GPU_KIT given"; exit 1; }
mkdir -p "$work/bin" "$work/hookbin"
if [ -x "$bundle/nvidia-ctk" ]; then
	# The CDI spec, from NVML and the host's ld cache, with the kit's hook.
	mkdir -p "$work/cdi"
	start=$(date +%s.%N)
	"$bundle/nvidia-ctk" cdi generate --output "$work/cdi/nvidia.yaml" --nvidia-cdi-hook-path "$bundle/nvidia-cdi-hook" >"$work/cdi-generate.log" 2>&1 ||
		{ echo "FAIL nvidia-ctk cdi generate"; cat "$work/cdi-generate.log"; exit 1; }
	echo "nvidia-ctk cdi generate: $(secs "$start" "$(date +%s.%N)") s; devices: $("$bundle/nvidia-ctk" cdi list --spec-dir "$work/cdi" 2>/dev/null | grep -v '^INFO' | tr '\n' ' ')"
	echo "CDI spec: $(grep -c 'containerPath' "$work/cdi/nvidia.yaml") container paths, $(grep -c 'hookName' "$work/cdi/nvidia.yaml") hooks"
	# Docker's NVIDIA device requests need a hook of this name on dockerd's
	# PATH; in CDI mode the runtime must drop it, so this one only leaves
	# a mark if it ever runs.
	printf '#!/bin/sh\ntouch %s/legacy-hook.ran\ncat >/dev/null\nexit 0\n' "$work" >"$work/hookbin/nvidia-container-runtime-hook"
	chmod +x "$work/hookbin/nvidia-container-runtime-hook"
	mkdir -p "$work/nvidia-container-runtime"
	cat >"$work/nvidia-container-runtime/config.toml" <<TOML
[nvidia-container-runtime]
debug = "$work/nvidia-runtime.log"
log-level = "debug"
mode = "cdi"
runtimes = ["$bundle/runc"]

[nvidia-container-runtime.modes.cdi]
annotation-prefixes = ["cdi.k8s.io/"]
default-kind = "nvidia.com/gpu"
spec-dirs = ["$work/cdi"]

[nvidia-ctk]
path = "$bundle/nvidia-ctk"

[nvidia-container-runtime-hook]
path = "$work/hookbin/nvidia-container-runtime-hook"
TOML
	printf '#!/bin/sh\nNVIDIA_CTK_CONFIG_FILE_PATH=%s exec %s "$@"\n' "$work/nvidia-container-runtime/config.toml" "$bundle/nvidia-container-runtime" >"$work/bin/nvidia-runtime-smoke"
	chmod +x "$work/bin/nvidia-runtime-smoke"
	dockerd_start cdi || exit 1
	image 1 0 || exit 1
	smoke cdi 1 cdi
	dockerd_stop
	dockerd_start runtime || exit 1
	smoke runtime 1 hook
	dockerd_stop
	exit "$fail"
fi

# No toolkit: the stand-ins. dockerd accepts NVIDIA device requests once a
# hook of this name is on its PATH (it does nothing here), and the runtime
# wrapper does the toolkit's device part: it maps the GPUs named in
# NVIDIA_VISIBLE_DEVICES (only those) into the container, with
# device-cgroup rules. The image carries the driver's user-space libraries.
echo "note: no nvidia-container-toolkit in the bundle; using a pass-through hook and a device-mapping runtime wrapper"
printf '#!/bin/sh\ncat >/dev/null\nexit 0\n' >"$work/hookbin/nvidia-container-runtime-hook"
chmod +x "$work/hookbin/nvidia-container-runtime-hook"
cat >"$work/bin/smoke-runc" <<PYEOF
#!/usr/bin/env python3
import glob, json, os, sys, traceback
args = sys.argv[1:]
def devices():
    cfg_path = os.path.join(args[args.index("--bundle") + 1], "config.json")
    cfg = json.load(open(cfg_path))
    env = dict(e.split("=", 1) for e in cfg.get("process", {}).get("env", []) if "=" in e)
    want = [u for u in env.get("NVIDIA_VISIBLE_DEVICES", "").split(",") if u and u != "void"]
    if want:
        minors = {}
        for f in glob.glob("/proc/driver/nvidia/gpus/*/information"):
            kv = dict(l.split(":", 1) for l in open(f) if ":" in l)
            minors[kv["GPU UUID"].strip()] = kv["Device Minor"].strip()
        paths = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
        paths += ["/dev/nvidia" + minors[u] for u in (minors if want == ["all"] else want)]
        lin = cfg.setdefault("linux", {})
        for p in paths:
            st = os.stat(p)
            lin.setdefault("devices", []).append({"path": p, "type": "c", "major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev), "fileMode": 0o666, "uid": 0, "gid": 0})
            lin.setdefault("resources", {}).setdefault("devices", []).append({"allow": True, "type": "c", "major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev), "access": "rwm"})
        json.dump(cfg, open(cfg_path, "w"))
if "create" in args and "--bundle" in args:
    try:
        devices()
    except Exception:
        open("$work/smoke-runc.err", "a").write(traceback.format_exc())
        raise
os.execv("$bundle/runc", ["runc"] + args)
PYEOF
chmod +x "$work/bin/smoke-runc"
dockerd_start standin || exit 1
image drv 1 || exit 1
smoke standin drv hook
dockerd_stop
exit "$fail"
