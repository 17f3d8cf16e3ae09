#!/usr/bin/env bash
# Trains a GPT whose training state (fp32 params + grads + AdamW's two
# moments, 16 bytes per param; the fp32 params are their own masters) is at
# least twice this machine's RAM, for a few steps on 2 local ranks: parameter
# shards and optimizer state live on NVMe (one swap file per rank and kind
# under the offload directory, offload_param and offload_optimizer "nvme"),
# gradient shards there too (with the optimizer state), each block's forward
# recomputed in backward;
# the same batch every step, so that a few steps show the loss falling
# (AdamW at lr 3e-6: at 3e-5 the 29-block stack overshoots, 4.42 -> 7.11).
# Prints each step's loss and time, each rank's memory and peak RSS, and
# writes the run's JSON line to build/demo/big_model.json.
#
#   scripts/big_model_demo.sh [offload dir, default build/demo/offload] [steps, default 3]
#
# Needs about 16 bytes per param of free disk under the offload directory
# (shards 4, moments 8, gradients 4) and says so, without running, when
# there is less.
# First the small twin (the same settings on a small GPT, with and without
# offload: the same losses). Run scripts/setup.sh first. Not part of the
# test command: it takes about 10 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-build/demo/offload}"
steps="${2:-3}"
mkdir -p "$dir" build/demo

# The smallest stack of 3072-wide blocks whose state reaches 2x RAM.
read -r ram layers params state <<<"$(.venv/bin/python - <<'EOF'
import os
ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
dim, ctx = 3072, 32
vocab = len(set(open("examples/python/data/corpus.txt").read()))
per_layer = 12 * dim * dim + 13 * dim
other = (2 * vocab + ctx + 2) * dim
layers = 1
target = 2 * -(-ram // 2**30) * 2**30  # twice RAM in whole GiB (23.5 GiB -> 48 GiB)
while 16 * (layers * per_layer + other) < target:
    layers += 1
params = layers * per_layer + other
print(ram, layers, params, 16 * params)
EOF
)"
[ -n "$layers" ] || { echo "big model: could not size the model" >&2; exit 1; }
need=$((params * 16 + (1 << 30)))
free=$(df --output=avail -B1 "$dir" | tail -1)
gib() { awk -v b="$1" 'BEGIN {printf "%.1f GiB", b / 2^30}'; }
echo "big model: $layers blocks of width 3072, $params params; training state $(gib "$state")" \
     "= $(awk -v s="$state" -v r="$ram" 'BEGIN {printf "%.2f", s / r}')x RAM ($(gib "$ram"))"
if [ "$free" -lt "$need" ]; then
  echo "big model: skipped: $dir has $(gib "$free") free, the swap files need $(gib "$need")"
  exit 0
fi

export PYTHONPATH=bindings/python ZEROSHARD_LIBRARY="$PWD/build/lib/libzeroshard.so"
export OMP_NUM_THREADS=1 ZS_HOST_CACHE_MB=0 ZS_TIMEOUT_MS=1800000

# Its small twin first: the same settings on a small GPT, with and without
# offload, must give the same losses.
twin() {
  build/bin/zsrun -n 2 -- .venv/bin/python examples/python/train_gpt.py --steps 5 --log-every 100 \
    --fixed-batch --checkpoint-activations "$@" | grep '^\[rank 0\] {' | sed 's/^\[rank 0\] //'
}
plain=$(twin)
offloaded=$(twin --offload-dir "$dir" --max-in-cpu 0 --sub-group-size 5000)
.venv/bin/python - "$plain" "$offloaded" <<'EOF'
import json, sys
a, b = (json.loads(x)["losses"] for x in sys.argv[1:3])
print("small twin: losses in memory ", " ".join(f"{x:.6f}" for x in a))
print("small twin: losses offloaded ", " ".join(f"{x:.6f}" for x in b))
if a != b:
    sys.exit("small twin: the losses differ with offload")
print("small twin: bitwise the same")
EOF

# Memory-lean fetch settings: at most ~600 MB of gathered params at once.
lean='{"zero_optimization": {"max_live_parameters": 150000000, "prefetch_bucket_size": 50000000,
       "max_reuse_distance": 0, "reduce_bucket_size": 20000000}}'
start=$(date +%s)
build/bin/zsrun -n 2 -- .venv/bin/python examples/python/train_gpt.py \
  --dim 3072 --heads 24 --layers "$layers" --ctx 32 --batch 1 --steps "$steps" --lr 3e-6 --log-every 1 --fixed-batch \
  --offload-dir "$dir" --max-in-cpu 2e7 --sub-group-size 1e7 --checkpoint-activations \
  --config-json "$lean" | tee build/demo/big_model.log
grep '^\[rank 0\] {' build/demo/big_model.log | sed 's/^\[rank 0\] //' > build/demo/big_model.json
echo "big model: $(($(date +%s) - start)) s in all; build/demo/big_model.json"
