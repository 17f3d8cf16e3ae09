#!/usr/bin/env bash
# Every test: build, then the whole CTest suite (GoogleTest cases, each in
# its own process; multi-rank cases fork real ranks over loopback), then the
# Python binding's pytest suite under Debian's interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
ctest --test-dir build --output-on-failure -j"${CTEST_JOBS:-2}"
ZEROSHARD_LIBRARY="$PWD/build/lib/libzeroshard.so" /usr/bin/python3 -m pytest -q bindings/python/tests
