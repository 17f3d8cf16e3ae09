# Stage times against the suite's budget (issue 61), sourced by
# scripts/test.sh and scripts/sanitize.sh. CI stops `.ci/run` at 90 minutes,
# and its machines differ by up to 1.6x in speed, so the suite is held to a
# budget well inside that: each stage has a share of ZS_SUITE_BUDGET_S
# (default 2100 s, 35 minutes from a bare machine) and is shown against it
# when it ends; a stage past its share is a loud warning, and the whole
# suite past ZS_SUITE_HARD_LIMIT_S (default 4200 s, 70 minutes) fails,
# naming the stages that went past their share. A slow suite is then found
# by the change that made it slow.
#
#   run_stage NAME COMMAND...   runs COMMAND as stage NAME and records its time
#                               (ZS_STAGE_BACKGROUND=1: a stage run beside the
#                               others, listed without a share)
#
# The first script that sources this starts the clock (ZS_SUITE_START) and
# the record (ZS_STAGE_LOG), and prints the table of every stage when it
# exits; scripts it runs inherit both, so sanitize.sh under test.sh adds its
# stages to the same table.

if [ -z "${ZS_SUITE_START:-}" ]; then
  ZS_SUITE_START=$(date +%s)
  ZS_STAGE_LOG=$(mktemp -t zs_stages.XXXXXX)
  # The table once, at the end of the script that started the clock, however it ends.
  trap 'stage_summary; rm -f "$ZS_STAGE_LOG"' EXIT
fi
export ZS_SUITE_START ZS_STAGE_LOG
: "${ZS_SUITE_BUDGET_S:=2100}"
: "${ZS_SUITE_HARD_LIMIT_S:=4200}"

# Each stage's share of the budget, in per mille, from this machine's kind
# (2 cores) from a bare machine: apt and the venv from PyPI in `setup`; with
# the venv cached `setup` is seconds and the suite has that much more room.
# sanitizer_wait: what the sanitizer builds, started in the background
# beside docs, ctest and pytest (scripts/test.sh), still need once cargo is
# done; the builds themselves are listed as overlapped, without a share.
declare -A ZS_STAGE_SHARE=(
  [setup]=120 [build]=110 [docs]=10 [ctest]=80 [pytest]=330 [cargo]=30 [sanitizer_wait]=60
  [asan_build]=90 [asan_tests]=100 [tsan_build]=50 [tsan_tests]=50 [fuzz_build]=20 [fuzz_runs]=20
)

stage_budget() {
  echo $(( ZS_SUITE_BUDGET_S * ${ZS_STAGE_SHARE[$1]:-50} / 1000 ))
}

stage_summary() {
  [ -s "$ZS_STAGE_LOG" ] || return 0
  local total=$(( $(date +%s) - ZS_SUITE_START ))
  echo
  echo "== stage times (budget ${ZS_SUITE_BUDGET_S} s, hard limit ${ZS_SUITE_HARD_LIMIT_S} s) =="
  printf '%-15s %8s %8s %6s\n' stage seconds budget share
  local name took budget
  while read -r name took budget; do
    if [ "$budget" -lt 0 ]; then
      printf '%-15s %8d %8s %6s  overlapped (background)\n' "$name" "$took" - -
      continue
    fi
    printf '%-15s %8d %8d %5d%%%s\n' "$name" "$took" "$budget" $(( 100 * took / (budget > 0 ? budget : 1) )) \
      "$([ "$took" -gt "$budget" ] && echo '  OVER')"
  done <"$ZS_STAGE_LOG"
  printf '%-15s %8d %8d %5d%%\n' total "$total" "$ZS_SUITE_BUDGET_S" $(( 100 * total / ZS_SUITE_BUDGET_S ))
}

run_stage() {
  local name=$1; shift
  local start rc took budget total over
  start=$(date +%s)
  echo "== stage $name =="
  # In a subshell with errexit on: under `if`, bash would ignore a failing
  # command inside a stage's function and go on with the next.
  local errexit=0
  [[ $- == *e* ]] && errexit=1
  set +e
  (set -e; "$@")
  rc=$?
  [ "$errexit" = 1 ] && set -e
  took=$(( $(date +%s) - start ))
  budget=$(stage_budget "$name")
  total=$(( $(date +%s) - ZS_SUITE_START ))
  if [ "${ZS_STAGE_BACKGROUND:-0}" = 1 ]; then
    # Beside the suite's foreground stages: its time is not on the suite's
    # path, so no share; a failure is the waiting stage's to report.
    echo "$name $took -1" >>"$ZS_STAGE_LOG"
    echo "== stage $name (background): ${took} s =="
    [ "$rc" -eq 0 ] || { echo "stage $name failed (exit $rc)" >&2; exit "$rc"; }
    return 0
  fi
  echo "$name $took $budget" >>"$ZS_STAGE_LOG"
  echo "== stage $name: ${took} s of its ${budget} s share; suite at ${total} s of ${ZS_SUITE_BUDGET_S} s =="
  if [ "$took" -gt "$budget" ]; then
    echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!" >&2
    echo "!!! BUDGET WARNING: stage $name took ${took} s, past its ${budget} s share" >&2
    echo "!!! of the ${ZS_SUITE_BUDGET_S} s suite budget (scripts/stage_budget.sh)." >&2
    echo "!!! Make it pay for its time before CI's 90 minutes run out." >&2
    echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!" >&2
  fi
  if [ "$rc" -ne 0 ]; then
    echo "stage $name failed (exit $rc)" >&2
    exit "$rc"
  fi
  if [ "$total" -gt "$ZS_SUITE_HARD_LIMIT_S" ]; then
    over=$(awk '$2 > $3 {printf "%s%s (%d s, share %d s)", sep, $1, $2, $3; sep=", "}' "$ZS_STAGE_LOG")
    echo "FAILED: the suite has run ${total} s, past its hard limit of ${ZS_SUITE_HARD_LIMIT_S} s" \
         "(ZS_SUITE_HARD_LIMIT_S), after stage $name; stages past their share: ${over:-none}" >&2
    exit 3
  fi
}
