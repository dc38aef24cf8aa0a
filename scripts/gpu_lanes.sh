#!/usr/bin/env bash
# GPU tests on a lent machine, wheelhouse/ carried. One-GPU tests run in parallel lanes (one GPU each); then the
# tests that need several GPUs run with every GPU visible (VERL_TEST_MIN_GPUS=2).
# Usage: bash scripts/gpu_lanes.sh OUT_DIR lanes "FILES..." "FILES..." ...   (one quoted file list per GPU)
#        bash scripts/gpu_lanes.sh OUT_DIR multi FILES...
# Each lane writes OUT_DIR/<lane>.log and OUT_DIR/<lane>.xml (junit).
set -uo pipefail
out=$(realpath "$1")
mode=$2
shift 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site wheelhouse/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sort | uniq -c
run() {  # lane name, then pytest arguments
  local name=$1
  shift
  timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu --junitxml="$out/$name.xml" "$@" >"$out/$name.log" 2>&1
  echo "$name: $(grep -E '(passed|failed|error)' "$out/$name.log" | tail -1)"
}
if [ "$mode" = lanes ]; then
  gpu=0
  for files in "$@"; do
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=$gpu run "lane$gpu" $files &
    gpu=$((gpu + 1))
  done
  wait
else
  VERL_TEST_MIN_GPUS=2 run multi "$@"
fi
grep -h -E "^(FAILED|ERROR)" "$out"/*.log | head -40
