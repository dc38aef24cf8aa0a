#!/usr/bin/env bash
# The packages' distributed CPU suites (gloo, several processes per test) N times in a row while two CPU-bound
# processes load the machine: the check that CI holds on a busy 2-core runner (issue 35, item 13). Stops at the
# first failing run; its log keeps every rank's stderr. Usage: bash scripts/cpu_soak.sh [runs, default 5]
# SOAK_PATHS: other test paths (e.g. SOAK_PATHS=tests for the cross-package suite); SOAK_OUT: the log folder.
set -u
cd "$(dirname "$0")/.."
runs=${1:-5}
out=${SOAK_OUT:-/tmp/cpu_soak}
mkdir -p "$out"
python3 -c "while True: pass" & b1=$!
python3 -c "while True: pass" & b2=$!
trap 'kill $b1 $b2 2>/dev/null' EXIT
for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  # shellcheck disable=SC2086  # SOAK_PATHS is a list of paths
  .venv/bin/python -m pytest -q -p no:cacheprovider -rfE \
    ${SOAK_PATHS:-packages/verl-mcore-utils/tests packages/verl-dyncp/tests packages/verl-mfsdp/tests} >"$out/run_$i.log" 2>&1
  rc=$?
  echo "run $i: rc=$rc, $(($(date +%s) - start)) s: $(tail -1 "$out/run_$i.log")" | tee -a "$out/summary"
  [ "$rc" -ne 0 ] && exit "$rc"
done
