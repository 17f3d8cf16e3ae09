#!/usr/bin/env bash
# Main demo: build, then train a small character-level GPT with zeroshard on
# 4 local ranks (examples/python/train_gpt.py under zsrun, the venv's
# Python): loss and tokens/s per step, each rank's memory (the engine's
# shards of params, gradients and AdamW state, and peak RSS) next to what
# DDP would hold on every rank, and a PNG of loss and per-rank memory.
#
#   scripts/demo.sh [more train_gpt.py options, e.g. --steps 200 --dim 256]
#
# ZS_DEMO_PLOT names the PNG (default build/demo/training.png); the full
# output, with the example's closing JSON line, goes to training.log beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
plot="${ZS_DEMO_PLOT:-build/demo/training.png}"
log="$(dirname "$plot")/training.log"
mkdir -p "$(dirname "$plot")"
PYTHONPATH="$PWD/bindings/python${PYTHONPATH:+:$PYTHONPATH}" \
ZEROSHARD_LIBRARY="$PWD/build/lib/libzeroshard.so" \
  build/bin/zsrun -n 4 -- .venv/bin/python examples/python/train_gpt.py \
    --steps 80 --log-every 1 --plot "$plot" "$@" | tee "$log" | grep -v '^\[rank 0\] {'
echo "demo: plot $plot, full output $log"
