#!/usr/bin/env bash
# Sanitizer and fuzz runs (issue 13, part 6); scripts/test.sh runs all three.
#
#   scripts/sanitize.sh [asan] [tsan] [fuzz]      (no argument: all three)
#   scripts/sanitize.sh builds | runs             (the three builds, or their runs)
#
# asan: build-asan/, g++ with -fsanitize=address,undefined: the engine and
#       zs_tests, then every GoogleTest case through ctest. Any ASan, UBSan or
#       LeakSanitizer report aborts the process that made it; a forked rank
#       that aborts is a failed test in its parent (tests/support/multirank.cpp
#       reports "died by signal 6"), and SanitizerCanary checks that this
#       chain really fails a test.
# tsan: build-tsan/, g++ with -fsanitize=thread: the threaded tests (store,
#       bootstrap, collectives, gather, coordinator, grad/optimizer steps,
#       failure, engine lock, kernels' thread pool, the NVMe swapper, the
#       checkpoint writer's thread), with the same canary.
# fuzz: build-fuzz/, clang with libFuzzer+ASan+UBSan: each target of
#       tests/fuzz/ (the config parser, the store's request decoding, the
#       store server, a checkpoint's manifest.json, a safetensors file) runs
#       $ZS_FUZZ_RUNS (default 20000) inputs from its corpus in
#       tests/fuzz/corpus/<target>/ (new inputs go to a scratch folder, the
#       kept corpus is not touched), mutated from the fixed seed
#       $ZS_FUZZ_SEED (default 1; 0: a fresh random seed): the same tree runs
#       the same inputs, so the gate's verdict moves only with a change to
#       what the targets build, not with the draw; exploring is the long
#       runs' job (docs/sanitizers.md).
#
# Builds use $ZS_JOBS parallel jobs (default: nproc), ctest $CTEST_JOBS
# (default 2), and ccache when installed (scripts/ccache.sh). Each build and
# each run is a stage of scripts/stage_budget.sh: its time is printed against
# its share of the suite's budget.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/stage_budget.sh
source scripts/ccache.sh

jobs="${ZS_JOBS:-$(nproc)}"
ctest_jobs="${CTEST_JOBS:-2}"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(asan tsan fuzz)

common=(-DZS_WITH_CUDA=OFF -DZS_BUILD_BENCH=OFF -DZS_BUILD_EXAMPLES=ON -DCMAKE_BUILD_TYPE=Debug)
# Line tables only (-g1), not full debug info: a report's stacks keep their
# functions, files and lines (the canaries check), and the engine's files
# compile in a third less time (optimizer.cpp under ASan at -O1: 15.1 ->
# 10.1 s; a test file at -O0: 7.2 -> 6.7 s), which a bare machine's builds
# spend beside pytest.
common+=(-DCMAKE_C_FLAGS_DEBUG=-g1 -DCMAKE_CXX_FLAGS_DEBUG=-g1
         "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG")
# The test sources at -O0 (the engine at -O1, below): they compiled at about
# 30 s each at -O1 under ASan on 2 cores, 13 s at -O0, which halves the
# build that dominates this script's time.
tests_o0=(-DZS_TESTS_UNOPTIMIZED=ON)
# What the GoogleTest cases run: the suite, the launcher, and the C examples
# some cases start under zsrun (they link the shared library).
targets=(zs_tests zsrun zsstore gather_layers train_mlp)
# -O1: a tolerable speed with exact stacks. -Wno-maybe-uninitialized: g++ 12
# warns falsely under -fsanitize=address inside libstdc++'s <regex>
# (std::function in _StateT), and the project builds with -Werror.
gcc_extra="-O1 -Wno-maybe-uninitialized"

# The tests that ctest must not run in a sanitizer build: they are not
# GoogleTest cases of the engine (the install check builds a consumer with
# plain flags, the ABI checks build C programs of their own, the others read
# sources, the Java test runs the binding's own build), and zs_tests alone
# is built there.
not_gtest='^(install_and_consume|layering.*|abi_.*|julia_.*|java_.*)$'

t0=$SECONDS

# The canary: a deliberate bug in a forked rank must fail the test that
# forks it, with the sanitizer's report in its output.
canary() {
  local dir=$1 test=$2 expect=$3 out
  if out=$("$dir/bin/zs_tests" --gtest_also_run_disabled_tests --gtest_filter="$test" 2>&1); then
    echo "$out" | tail -20
    echo "sanitize: canary $test passed in $dir, so sanitizer reports in forked ranks would not fail tests" >&2
    exit 1
  fi
  if ! grep -q "$expect" <<<"$out" || ! grep -q "died by signal" <<<"$out"; then
    echo "$out" | tail -40
    echo "sanitize: canary $test failed in $dir without '$expect' and a rank dying by a signal" >&2
    exit 1
  fi
  if ! grep -Eq "sanitizer_canary_test\.cpp:[0-9]+" <<<"$out"; then
    echo "$out" | tail -40
    echo "sanitize: canary $test's report names no line of sanitizer_canary_test.cpp: the stacks lost their line tables" >&2
    exit 1
  fi
  echo "sanitize: canary $test fails as it must ($expect)"
}

asan_build() {
  local san="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
  cmake -S . -B build-asan "${common[@]}" "${tests_o0[@]}" "${ZS_CCACHE_FLAGS[@]}" -DCMAKE_C_FLAGS="$san" \
    -DCMAKE_CXX_FLAGS="$san $gcc_extra" -DCMAKE_EXE_LINKER_FLAGS="$san" \
    -DCMAKE_SHARED_LINKER_FLAGS="$san" >/dev/null
  cmake --build build-asan -j"$jobs" --target "${targets[@]}"
}

asan_tests() {
  export ASAN_OPTIONS="halt_on_error=1:abort_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1"
  export UBSAN_OPTIONS="halt_on_error=1:abort_on_error=1:print_stacktrace=1"
  export LSAN_OPTIONS="suppressions=$PWD/tests/sanitizers/lsan.supp:print_suppressions=0"
  canary build-asan SanitizerCanary.DISABLED_HeapUseAfterFreeInAForkedRank "heap-use-after-free"
  ctest --test-dir build-asan --output-on-failure -j"$ctest_jobs" -E "$not_gtest"
  unset ASAN_OPTIONS UBSAN_OPTIONS LSAN_OPTIONS
}

# The threaded tests: every suite that runs engine threads (the store's
# server thread, a group's collective thread, Gloo's pairs, the kernels'
# pool). Left out: the parser, kernel arithmetic, CUDA/NCCL (skipped without
# a GPU) and zsrun (a launcher without threads of its own).
tsan_filter='CollectiveIdentity.*:CrossMemory.*:Ranks/ReduceScatterRing.*:Heartbeat.*:JobSecret.*:Swapper.*:Settings/SwapperAio.*:TcpStore.*:StoreJournal.*:StoreSemantics*:FileStore.*:PrefixStore.*:Bootstrap.*:Collectives*:Gather*:Coordinator.*:Train*:Optimizer*:Unregister.*:Failure.*:EngineLock.*:Topology.*:MicsHierarchical.*:Hpz.*:LocoTopology.*:ConfigAgreement.*:KernelsParallel.*:KernelsOptimThreads.*:LossScaler.*:CheckpointDirectIo*:Checkpoint.SameWorldSizeResumesBitwise:ParamOffload*:Cases/ParamOffload.*:Cases/OptimizerOffload.*:Heal*:SharedMemoryRings.*:Ranks/RingsWorld.*'

# The files that hold the suites above (and the canary): the TSan build
# compiles only these (tests/CMakeLists.txt, ZS_TEST_FILES), which
# tsan_build checks against the filter on the full suite.
tsan_files=(bootstrap_test.cpp checkpoint_direct_io_test.cpp checkpoint_test.cpp collective_identity_test.cpp
            collectives_test.cpp config_agreement_test.cpp coordinator_test.cpp cross_memory_test.cpp
            engine_lock_test.cpp failure_test.cpp gather_test.cpp heal_commit_test.cpp heal_join_test.cpp heal_loss_test.cpp heal_regrow_test.cpp heal_shrink_test.cpp heal_test.cpp heal_two_optimizers_test.cpp
            heal_zsrun_test.cpp
            heartbeat_test.cpp
            job_secret_test.cpp kernels_optim_test.cpp loco_test.cpp loss_scaler_test.cpp optimizer_agreement_test.cpp
            optimizer_bf16_states_test.cpp optimizer_external_test.cpp optimizer_muon_test.cpp optimizer_offload_grads_test.cpp
            optimizer_many_test.cpp optimizer_offload_test.cpp optimizer_test.cpp param_offload_test.cpp sanitizer_canary_test.cpp
            grad_discard_test.cpp
            shared_memory_rings_test.cpp store_test.cpp swapper_test.cpp topology_gather_test.cpp topology_test.cpp train_test.cpp
            unregister_test.cpp)

# The tests a zs_tests binary holds that the TSan filter picks.
tsan_picks() {
  "$1" --gtest_list_tests --gtest_filter="$tsan_filter" | awk '/^[^ ]/ {suite=$1} /^  / {print suite $1}'
}

tsan_build() {
  local san="-fsanitize=thread -fno-omit-frame-pointer"
  cmake -S . -B build-tsan "${common[@]}" "${tests_o0[@]}" "${ZS_CCACHE_FLAGS[@]}" -DCMAKE_C_FLAGS="$san" \
    -DCMAKE_CXX_FLAGS="$san $gcc_extra" -DCMAKE_EXE_LINKER_FLAGS="$san" \
    -DCMAKE_SHARED_LINKER_FLAGS="$san" -DZS_TEST_FILES="$(IFS=';'; echo "${tsan_files[*]}")" >/dev/null
  cmake --build build-tsan -j"$jobs" --target "${targets[@]}"
  # Every test the filter picks in the whole suite (the ASan build's
  # zs_tests, configured as this one, or the plain build's less the suites
  # only a CUDA build compiles, which the sanitizer builds leave out) must be
  # in this build: a new threaded suite in a file not listed above would
  # otherwise go untested under TSan.
  local full=build-asan/bin/zs_tests missing
  [ -x "$full" ] || full=build/bin/zs_tests
  if [ -x "$full" ]; then
    missing=$(comm -23 <(tsan_picks "$full" | grep -Ev '^[A-Za-z0-9]*(Cuda|Nccl)' | sort) \
                       <(tsan_picks build-tsan/bin/zs_tests | sort))
    if [ -n "$missing" ]; then
      echo "$missing" | head -20 >&2
      echo "sanitize: the TSan build lacks the tests above, which its filter picks: add their files to tsan_files in scripts/sanitize.sh" >&2
      return 1
    fi
  fi
}

tsan_tests() {
  # halt_on_error: a forked rank leaves with _exit(), which skips TSan's
  # exit-code check, so the first report must abort the rank there and then.
  export TSAN_OPTIONS="halt_on_error=1:abort_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/sanitizers/tsan.supp"
  canary build-tsan SanitizerCanary.DISABLED_DataRaceInAForkedRank "data race"
  # KernelsParallel.UsableInAForkedChildWhileTheParentPoolIsBusy forks while
  # the parent's threads run and starts threads in the child, which TSan
  # cannot follow ("starting new threads after multi-threaded fork is not
  # supported"); it runs in the ASan build.
  # Coordinator.AStepTooLong... fetches 2^18 times on one rank: the threads
  # of the coordinator's other cases, for minutes under TSan.
  ctest --test-dir build-tsan --output-on-failure -j"$ctest_jobs" \
    -E "$not_gtest|^KernelsParallel\.UsableInAForkedChildWhileTheParentPoolIsBusy\$|^Coordinator\.AStepTooLongToRecordGathersOnDemandAndKeepsTheOrders\$" \
    -R "$(tr ':' '\n' <<<"$tsan_filter" | sed 's/\./\\./; s/\*$/.*/; s/^/^/' | paste -sd'|')"
  unset TSAN_OPTIONS
}

fuzz_targets=(config store_request store_server ckpt_manifest safetensors)

fuzz_build() {
  local san="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
  cmake -S . -B build-fuzz "${common[@]}" "${ZS_CCACHE_FLAGS[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DZS_BUILD_TESTS=OFF -DZS_BUILD_EXAMPLES=OFF \
    -DZS_BUILD_FUZZERS=ON -DCMAKE_C_FLAGS="$san" -DCMAKE_CXX_FLAGS="$san" >/dev/null
  cmake --build build-fuzz -j"$jobs" --target "${fuzz_targets[@]/#/fuzz_}"
}

fuzz_runs() {
  export ASAN_OPTIONS="halt_on_error=1:abort_on_error=1:detect_leaks=1"
  export UBSAN_OPTIONS="halt_on_error=1:abort_on_error=1:print_stacktrace=1"
  local scratch
  scratch=$(mktemp -d)
  for target in "${fuzz_targets[@]}"; do
    local dict=() max_len=4096
    [ -f "tests/fuzz/$target.dict" ] && dict=(-dict="tests/fuzz/$target.dict")
    # A real manifest of a few params with optimizer states is 4-7 KiB.
    [ "$target" = ckpt_manifest ] && max_len=8192
    mkdir -p "$scratch/$target"
    if ! "build-fuzz/bin/fuzz_$target" -runs="${ZS_FUZZ_RUNS:-20000}" -seed="${ZS_FUZZ_SEED:-1}" \
      -max_len="$max_len" "${dict[@]}" \
      -artifact_prefix="build-fuzz/crash-$target-" -print_final_stats=1 \
      "$scratch/$target" "tests/fuzz/corpus/$target" >"build-fuzz/fuzz_$target.log" 2>&1; then
      tail -60 "build-fuzz/fuzz_$target.log"
      rm -rf "$scratch"
      echo "sanitize: fuzz_$target failed (log above, build-fuzz/fuzz_$target.log); the input is build-fuzz/crash-$target-*" >&2
      exit 1
    fi
    echo "sanitize: fuzz_$target: $(grep -E '^Done' "build-fuzz/fuzz_$target.log")"
  done
  rm -rf "$scratch"
  unset ASAN_OPTIONS UBSAN_OPTIONS
}

# Each step's build, then its run; `builds` and `runs` split them, so that
# scripts/test.sh can build in the background while the suite runs.
for step in "${steps[@]}"; do
  case "$step" in
    asan) run_stage asan_build asan_build; run_stage asan_tests asan_tests ;;
    tsan) run_stage tsan_build tsan_build; run_stage tsan_tests tsan_tests ;;
    fuzz) run_stage fuzz_build fuzz_build; run_stage fuzz_runs fuzz_runs ;;
    builds) run_stage asan_build asan_build; run_stage tsan_build tsan_build; run_stage fuzz_build fuzz_build ;;
    runs) run_stage asan_tests asan_tests; run_stage tsan_tests tsan_tests; run_stage fuzz_runs fuzz_runs ;;
    *) echo "usage: scripts/sanitize.sh [asan] [tsan] [fuzz] | builds | runs" >&2; exit 2 ;;
  esac
done
echo "sanitize: ${steps[*]} took $((SECONDS - t0)) s"
