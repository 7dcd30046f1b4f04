#!/bin/bash
# GPU smoke test for a machine with an NVIDIA driver: a real dstack-shim
# discovers the GPUs through NVML and runs a CUDA job through `tandem run`
# with --gpus 1, in a container built here from the host's own driver
# libraries and a CUDA program compiled here with nvcc.
#
#   scripts/gpu-smoke.sh [DOCKER_BUNDLE]
#
# Uses the running Docker daemon. Without one, DOCKER_BUNDLE names a
# directory holding dockerd, containerd, containerd-shim-runc-v2, runc,
# docker-init (and lib/ with their shared libraries): they are started with
# a private root. When nvidia-container-toolkit is absent, a pass-through
# `nvidia-container-runtime-hook` is put on dockerd's PATH so the shim's
# NVIDIA device request is accepted; the task is privileged (--privileged)
# so /dev/nvidia* are visible, and the image carries the driver's user-space
# libraries (what the toolkit would mount). Prints PASS or FAIL lines and
# exits non-zero on any failure.
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

nvidia-smi -L || { echo "FAIL no NVIDIA driver (nvidia-smi)"; exit 1; }

# 1. Docker.
export DOCKER_HOST=unix:///var/run/docker.sock
sock=/var/run/docker.sock
if ! curl -sf --unix-socket "$sock" http://d/_ping >/dev/null 2>&1; then
	bundle=${1:?no Docker daemon running and no DOCKER_BUNDLE given}
	mkdir -p "$work/bin"
	cp -a "$bundle"/* "$work/bin/"
	runtime_flags=()
	if ! command -v nvidia-container-runtime-hook >/dev/null; then
		# Stand-ins for nvidia-container-toolkit, which cannot be installed
		# here: dockerd accepts NVIDIA device requests once a hook of this
		# name is on its PATH (it does nothing here), and the runtime
		# wrapper below does the toolkit's device part: it maps the GPUs
		# named in NVIDIA_VISIBLE_DEVICES (and only those) into the
		# container, with device-cgroup rules. The image carries the
		# driver's user-space libraries.
		printf '#!/bin/sh\ncat >/dev/null\nexit 0\n' >"$work/bin/nvidia-container-runtime-hook"
		chmod +x "$work/bin/nvidia-container-runtime-hook"
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
os.execv("$work/bin/runc", ["runc"] + args)
PYEOF
		chmod +x "$work/bin/smoke-runc"
		runtime_flags=(--add-runtime "smoke=$work/bin/smoke-runc" --default-runtime smoke)
		echo "note: nvidia-container-toolkit absent; using a pass-through hook and a device-mapping runtime wrapper"
	fi
	mkdir -p "$work/docker" /var/run
	PATH="$work/bin:$PATH" LD_LIBRARY_PATH="$work/bin/lib" setsid dockerd --data-root "$work/docker" \
		--exec-root "$work/exec" --pidfile "$work/dockerd.pid" --host "unix://$sock" \
		--iptables=false --ip6tables=false --bridge=none "${runtime_flags[@]}" >"$work/dockerd.log" 2>&1 </dev/null &
	pids+=($!)
	for _ in $(seq 100); do curl -sf --unix-socket "$sock" http://d/_ping >/dev/null 2>&1 && break; sleep 0.2; done
	curl -sf --unix-socket "$sock" http://d/_ping >/dev/null || { echo "FAIL dockerd did not start"; tail -30 "$work/dockerd.log"; exit 1; }
	echo "dockerd $(curl -s --unix-socket "$sock" http://d/version | python3 -c 'import json,sys; print(json.load(sys.stdin)["Version"])') started"
fi

# 2. The CUDA job image: a vector add checked on the host side, plus
#    nvidia-smi, with exactly the libraries they load.
cat >"$work/smoke.cu" <<'CU'
#include <cstdio>
#include <cuda_runtime.h>
__global__ void add(const float *a, const float *b, float *c, size_t n) {
	size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
	if (i < n) c[i] = a[i] + b[i];
}
int main() {
	int n = 0;
	if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) { printf("no CUDA device\n"); return 2; }
	cudaDeviceProp p; cudaGetDeviceProperties(&p, 0);
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
root="$work/rootfs"
mkdir -p "$root/bin" "$root/lib64" "$root/etc" "$root/tmp" "$root/root" "$root/workflow"
chmod 1777 "$root/tmp"
cp "$work/cuda-smoke" "$(command -v nvidia-smi)" "$root/bin/"
cp -L /bin/sh "$root/bin/sh"
libcuda=$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')
libnvml=$(ldconfig -p | awk '/libnvidia-ml.so.1 /{print $NF; exit}')
for f in "$root/bin/"* "$libcuda" "$libnvml"; do
	ldd "$f" 2>/dev/null | awk '/=>/ {print $3} /ld-linux/ {print $1}'
done | sort -u | while read -r l; do [ -f "$l" ] && cp -L "$l" "$root/lib64/"; done
cp -L "$libcuda" "$root/lib64/libcuda.so.1"
cp -L "$libnvml" "$root/lib64/libnvidia-ml.so.1"
mkdir -p "$root/lib/x86_64-linux-gnu"
ln -s /lib64/ld-linux-x86-64.so.2 "$root/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" 2>/dev/null
printf 'root:x:0:0:root:/root:/bin/sh\n' >"$root/etc/passwd"
printf 'root:x:0:\n' >"$root/etc/group"
tar -C "$root" -cf "$work/rootfs.tar" .
curl -sf --unix-socket "$sock" -X POST -H 'Content-Type: application/x-tar' --data-binary "@$work/rootfs.tar" \
	"http://d/images/create?fromSrc=-&repo=tandem-cuda-smoke&tag=1&changes=ENV%20PATH%3D%2Fbin&changes=ENV%20LD_LIBRARY_PATH%3D%2Flib64" >/dev/null ||
	{ echo "FAIL image import"; exit 1; }
echo "image tandem-cuda-smoke:1: $(du -sh "$work/rootfs.tar" | cut -f1)"

# 3. The shim, with real NVML.
home="$work/shim"
mkdir -p "$home"
setsid bin/dstack-shim --shim-home "$home" --shim-http-port 20998 --service \
	--runner-binary-path "$PWD/bin/dstack-runner" --runner-http-port 20999 --runner-ssh-port 20022 \
	>"$work/shim.log" 2>&1 </dev/null &
pids+=($!)
for _ in $(seq 100); do bin/tandem info --shim 127.0.0.1:20998 >/dev/null 2>&1 && break; sleep 0.1; done
bin/tandem info --shim 127.0.0.1:20998
for _ in $(seq 50); do [ -s "$home/host_info.json" ] && break; sleep 0.1; done
info=$(cat "$home/host_info.json" 2>/dev/null)
echo "host_info.json: $info"
smi_uuid=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
smi_name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
smi_count=$(nvidia-smi -L | wc -l)
check "host_info.json reports the GPUs nvidia-smi sees ($smi_count x $smi_name)" grep -q "\"gpu_name\":\"$smi_name\".*\"gpu_count\":$smi_count," <<<"$info"

run() { bin/tandem run --shim 127.0.0.1:20998 --runner-port 20999 --image tandem-cuda-smoke:1 "$@"; }
start=$(date +%s.%N)
out=$(run --gpus 1 -- /bin/sh -c 'nvidia-smi -L; cuda-smoke' 2>&1)
rc=$?
end=$(date +%s.%N)
echo "$out"
echo "tandem run --gpus 1: exit $rc in $(python3 -c "print(round($end-$start,2))") s"
check "CUDA job exits 0" test "$rc" = 0
check "CUDA job verified its vector add on the GPU" grep -q "CUDA OK" <<<"$out"
check "the job sees the shim's GPU" grep -q "$smi_uuid" <<<"$out"
n=$(nvidia-smi -L | wc -l)
out=$(run --gpus $((n + 1)) -- /bin/sh -c true 2>&1)
rc=$?
echo "tandem run --gpus $((n + 1)): exit $rc: $(tail -2 <<<"$out")"
check "asking for more GPUs than the host has is refused" test "$rc" != 0
# While one task holds the GPU, a second GPU task is refused and the
# metrics count it allocated; once the first ends, the GPU is free again.
# (the image has no sleep: dash counts instead, a few seconds)
# shellcheck disable=SC2016 # expanded by the job's shell
run --gpus 1 -- /bin/sh -c 'cuda-smoke && i=0 && while [ $i -lt 3000000 ]; do i=$((i+1)); done' >"$work/bg.out" 2>&1 &
bg=$!
for _ in $(seq 50); do grep -q 'CUDA OK' "$work/bg.out" && break; sleep 0.2; done
alloc=$(curl -s http://127.0.0.1:20998/metrics | awk '/^tandem_shim_gpus\{state="allocated"\}/ {print $2}')
check "the running GPU task shows in the metrics (allocated=$alloc)" test "$alloc" = 1
out=$(run --gpus 1 -- /bin/sh -c true 2>&1)
echo "second --gpus 1 while the first runs: $(tail -1 <<<"$out")"
check "a second GPU task is refused while the GPU is held" grep -q "no capacity" <<<"$out"
wait "$bg"
bgrc=$?
check "the first GPU task ran to its end (exit $bgrc)" test "$bgrc" = 0
alloc=$(curl -s http://127.0.0.1:20998/metrics | awk '/^tandem_shim_gpus\{state="allocated"\}/ {print $2}')
check "the GPU is free again (allocated=$alloc)" test "$alloc" = 0
out=$(run --gpus 0 -- /bin/sh -c '[ -e /dev/nvidia0 ] && echo /dev/nvidia0 is visible; cuda-smoke' 2>&1)
echo "$out"
check "a job with --gpus 0 sees no GPU" grep -q "no CUDA device" <<<"$out"
curl -s http://127.0.0.1:20998/metrics | grep -E '^tandem_' | head -20
if [ "$fail" != 0 ]; then
	echo "--- shim log"; tail -40 "$work/shim.log"
	[ -f "$work/smoke-runc.err" ] && { echo "--- runtime wrapper"; cat "$work/smoke-runc.err"; }
	[ -f "$work/dockerd.log" ] && { echo "--- dockerd log"; tail -5 "$work/dockerd.log"; }
fi
exit "$fail"
