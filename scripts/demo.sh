#!/usr/bin/env bash
# Main demo: build, then partition a small model over 4 local ranks and
# gather it layer by layer.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build/bin/zsrun -n 4 -- build/bin/gather_layers
