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
#
# Each stage's time is printed against its share of the suite's budget
# (scripts/stage_budget.sh: a loud warning past a share, a failure naming the
# stages past their shares once the suite runs past its hard limit), with a
# table of every stage at the end and pytest's 25 slowest tests.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/stage_budget.sh

run_stage setup scripts/setup.sh install
run_stage build scripts/setup.sh build

# The sanitizer builds start now, in the background at the lowest CPU
# priority: they take the cores the stages below leave idle (pytest's ranks
# wait on one another much of the time: about one core of two in use on
# average), and the foreground stages keep the CPU whenever they want it.
# Their runs come after cargo, once sanitizer_wait has seen them built.
# In a session of their own, so that a suite that stops early stops them all.
builds_pid=
builds_rc=build/sanitizer_builds.rc
if [ "${ZS_SANITIZE:-1}" != 0 ]; then
  rm -f "$builds_rc"
  ZS_STAGE_BACKGROUND=1 setsid nice -n 19 bash -c \
    'scripts/sanitize.sh builds >build/sanitizer_builds.log 2>&1; echo $? >"$0"' "$builds_rc" &
  builds_pid=$!
  echo "test.sh: the sanitizer builds run in the background (log build/sanitizer_builds.log)"
fi
stop_builds() {
  [ -z "$builds_pid" ] || kill -TERM -- "-$builds_pid" 2>/dev/null || true
}
# pytest's 25 slowest tests again at the very end, under the stage table.
slowest_tests() {
  [ -f build/pytest.log ] || return 0
  echo
  sed -n '/slowest 25 durations/,/ passed\| failed\| error/p' build/pytest.log
}
trap 'stop_builds; stage_summary; slowest_tests; rm -f "$ZS_STAGE_LOG"' EXIT
# The documentation site (mkdocs.yml, docs/): --strict fails on a broken link
# or a page missing from the nav. Into build/site, which git ignores.
run_stage docs env NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir build/site
run_stage ctest ctest --test-dir build --output-on-failure -j"${CTEST_JOBS:-2}"
rm -f build/pytest.log
run_stage pytest bash -c 'set -o pipefail; ZEROSHARD_LIBRARY="$PWD/build/lib/libzeroshard.so" \
  .venv/bin/python -m pytest -q --durations=25 --durations-min=0 bindings/python/tests | tee build/pytest.log'
# From its folder, so that cargo reads bindings/rust/.cargo/config.toml.
cargo_tests() {
  (cd bindings/rust && ZEROSHARD_LIB_DIR="$1" cargo test --offline --workspace)
}
run_stage cargo cargo_tests "$PWD/build/lib"
if [ -n "$builds_pid" ]; then
  wait_for_builds() {
    while [ ! -s "$builds_rc" ] && kill -0 "$builds_pid" 2>/dev/null; do sleep 2; done
    if [ "$(cat "$builds_rc" 2>/dev/null)" != 0 ]; then
      tail -80 build/sanitizer_builds.log
      echo "test.sh: the sanitizer builds failed (log above, build/sanitizer_builds.log)" >&2
      return 1
    fi
    grep '^== stage' build/sanitizer_builds.log
  }
  run_stage sanitizer_wait wait_for_builds
  builds_pid=
  scripts/sanitize.sh runs
fi
