#!/usr/bin/env bash
# Every test: build, then the whole CTest suite (GoogleTest cases, each in
# its own process; multi-rank cases fork real ranks over loopback; the ABI
# checks), then the Python binding's pytest suite under the project's venv
# (.venv, made by scripts/setup.sh: torch, transformers, Lightning and
# DeepSpeed from PyPI), then the Rust crates' tests (offline, std only,
# built into build/rust), then the sanitizer and fuzz runs
# (scripts/sanitize.sh: ASan+UBSan suite, TSan threaded tests, libFuzzer
# smoke runs; build-asan/, build-tsan/, build-fuzz/). ZS_SANITIZE=0 skips
# those locally.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# The documentation site (mkdocs.yml, docs/): --strict fails on a broken link
# or a page missing from the nav. Into build/site, which git ignores.
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir build/site
ctest --test-dir build --output-on-failure -j"${CTEST_JOBS:-2}"
ZEROSHARD_LIBRARY="$PWD/build/lib/libzeroshard.so" .venv/bin/python -m pytest -q bindings/python/tests
# From its folder, so that cargo reads bindings/rust/.cargo/config.toml.
lib_dir="$PWD/build/lib"
(cd bindings/rust && ZEROSHARD_LIB_DIR="$lib_dir" cargo test --offline --workspace)
[ "${ZS_SANITIZE:-1}" = 0 ] || scripts/sanitize.sh
