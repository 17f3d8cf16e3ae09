#!/usr/bin/env bash
# Every test: build, then run the whole CTest suite (GoogleTest cases, each
# in its own process; multi-rank cases fork real ranks over loopback).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
ctest --test-dir build --output-on-failure -j"${CTEST_JOBS:-2}"
