#!/usr/bin/env bash
# The GPU proof, in one command, on a machine with an NVIDIA GPU, from a
# build made elsewhere (scripts/gpu_pack.sh puts it in .gpu-carry/):
#   1. the GPU tests (CUDA kernels against their CPU twins, the NCCL
#      communicator, the engine on CUDA);
#   2. the examples on CUDA against the same run on the CPU: train_mlp in a
#      world of one over NCCL and two ranks sharing the GPU over staged
#      Gloo, and the Python GPT example;
#   3. the GPU benchmarks (kernels against a device-to-device copy, the
#      optimizer step against torch's fused AdamW, the GPT step against
#      plain PyTorch and FSDP2); each prints one JSON object last.
# Logs go to $OUT (or gpu-check-out/) when set. Exits nonzero if any part
# failed, after running every part.
set -uo pipefail
cd "$(dirname "$0")/.."
carry=$PWD/.gpu-carry
out=${OUT:-$PWD/gpu-check-out}
mkdir -p "$out"
export LD_LIBRARY_PATH="$carry/lib:${LD_LIBRARY_PATH:-}"
export ZS_TEST_BIN_DIR="$carry/bin" ZEROSHARD_LIBRARY="$carry/lib/libzeroshard.so"
export PYTHONUNBUFFERED=1
failed=()
# step NAME SECONDS COMMAND...: run under a time limit, log to
# $out/NAME.log, remember failures. The limits add up to under 10 minutes
# (one device call's limit); the whole check ran in 3 min 16 s on an H200,
# so a rerun fits in a session's 15 minutes of device time.
step() {
  local name=$1 limit=$2 t0=$SECONDS rc=0
  shift 2
  echo "== $name (limit ${limit}s): $*"
  # bash -c so that the exported functions below (mlp, gpt) run too.
  timeout --kill-after=5 "$limit" bash -c '"$@"' "$name" "$@" >"$out/$name.log" 2>&1 || rc=$?
  if [ $rc -eq 0 ]; then
    tail -n 3 "$out/$name.log"
  else
    [ $rc -eq 124 ] && echo "TIMED OUT after ${limit}s ($name)"
    echo "FAILED ($name, status $rc), last lines:"
    tail -n 30 "$out/$name.log"
    failed+=("$name")
  fi
  echo "   ($((SECONDS - t0)) s)"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
echo "commit $(git rev-parse --short HEAD 2>/dev/null), build of $(cat "$carry/commit" 2>/dev/null)"

# Python binding: cffi comes from the carried sources when the image lacks it.
python3 -c "import cffi" 2>/dev/null || eval "$(bash scripts/gpu_build_cffi.sh)" ||
  echo "cffi could not be built: the Python parts will fail"
export PYTHONPATH="$PWD/bindings/python:${PYTHONPATH:-}"

gpu_tests='CudaKernels*:CudaEngine*:Nccl*:Device*:OptimizerBf16Cuda*:OptimizerOffloadCuda*'
step gpu-tests 120 bash -c "
  fails=0
  for t in \$('$carry/bin/zs_tests' --gtest_list_tests --gtest_filter='$gpu_tests' |
              awk '/^[^ ]/ {suite=\$1} /^  / {print suite \$1}'); do
    '$carry/bin/zs_tests' --gtest_filter=\"\$t\" --gtest_brief=1 || fails=\$((fails + 1))
  done
  echo \"\$fails failing test(s)\"
  [ \$fails -eq 0 ]"

mlp() { "$carry/bin/zsrun" -n "$1" --no-prefix -- "$carry/bin/train_mlp" --steps 50 "${@:2}"; }
export carry
export -f mlp
step mlp-cpu 20 mlp 1 --device cpu
step mlp-cuda-nccl 20 env ZS_BACKEND=nccl "$carry/bin/zsrun" -n 1 --no-prefix -- "$carry/bin/train_mlp" --steps 50 --device cuda
step mlp-cpu-2 20 mlp 2 --device cpu
step mlp-cuda-2-staged 20 env ZS_BACKEND=gloo "$carry/bin/zsrun" -n 2 --no-prefix -- "$carry/bin/train_mlp" --steps 50 --device cuda:0
step mlp-compare 10 python3 - "$out" <<'PY'
import re, sys
out = sys.argv[1]
def losses(name):
    return [float(m.group(1)) for m in re.finditer(r"^step \d+ loss (\S+)", open(f"{out}/{name}.log").read(), re.M)]
worst = 0.0
for cpu, gpu in (("mlp-cpu", "mlp-cuda-nccl"), ("mlp-cpu-2", "mlp-cuda-2-staged")):
    a, b = losses(cpu), losses(gpu)
    assert a and len(a) == len(b), (cpu, len(a), gpu, len(b))
    rel = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    worst = max(worst, rel)
    print(f"{gpu}: {len(b)} losses, max relative difference to {cpu}: {rel:.3g}")
assert worst <= 1e-5, worst
PY

gpt() { "$carry/bin/zsrun" -n 1 --no-prefix -- python3 examples/python/train_gpt.py --steps 20 "$@"; }
export -f gpt
step gpt-cpu 40 gpt --device cpu
step gpt-cuda 30 gpt --device cuda
step gpt-compare 10 python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def losses(name):  # the example's last line is a JSON object with every step's loss
    return json.loads(open(f"{out}/{name}.log").read().strip().splitlines()[-1])["losses"]
a, b = losses("gpt-cpu"), losses("gpt-cuda")
assert a and len(a) == len(b), (len(a), len(b))
rel = max(abs(x - y) / abs(x) for x, y in zip(a, b))
print(f"GPT on CUDA: {len(b)} losses, max relative difference to the CPU: {rel:.3g}")
assert rel <= 1e-4, rel
PY
step python-gpu-tests 60 python3 -m pytest -q bindings/python/tests/test_cuda.py

step bench-kernels 30 "$carry/bin/bench_gpu_kernels"
# The engine's multi-tensor AdamW step (opted in until this check has
# passed on a GPU: ZS_CUDA_MULTI_TENSOR) against torch's fused one: one 64M
# param, 1024 of 64K, 4096 of 4K.
step bench-optimizer 30 env ZS_CUDA_MULTI_TENSOR=1 python3 bench/bench_gpu_optimizer.py --layouts 1x64M,1024x64K,4096x4K --steps 10 --warmup 3
step bench-gpt-step 60 python3 bench/bench_gpu_step.py --steps 20
# The memory side at 300M params (24 blocks of 1024): zeroshard's peak
# (torch's allocator and the engine's pools) against torch and FSDP2.
step bench-gpt-step-300m 100 python3 bench/bench_gpu_step.py --dim 1024 --layers 24 --heads 16 --batch 8 \
  --steps 5 --warmup 2 --adamw-numel 0

echo "== summary"
for f in bench-kernels bench-optimizer bench-gpt-step bench-gpt-step-300m; do tail -n 1 "$out/$f.log"; done
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}"
  exit 1
fi
echo "every GPU check passed"
