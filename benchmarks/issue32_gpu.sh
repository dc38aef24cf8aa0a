#!/usr/bin/env bash
# Issue 32 on one GPU lease: the RL step (1.5B shape, 8 sequences of 4096 tokens, 8192-token micro-batches)
# before (.old/: the tree before the one-engine change) and after, alternated twice; the default
# `verl-engine train` on the GPU before / before with the new LR schedule / after / after with the old weight
# decay (every group decayed: the fix is the only difference to "after"); the GPU no-host-sync and
# optimizer-group tests.
# Usage (device machine, wheelhouse/ and .old/ carried): bash benchmarks/issue32_gpu.sh OUT_DIR PART... (rl_step, sft, tests)
set -uo pipefail
out=$(realpath "$1")
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site wheelhouse/*.whl || exit 1
export PYTHONUNBUFFERED=1
root=$(pwd)
new=/tmp/site
old="$root/.old/src:/tmp/site"
old_lr="$root/.old/src_lr:$root/.old/src:/tmp/site"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
step() { python3 "$1/engine_step_gpu.py" --variants fused --shape qwen2.5-1.5b --seq 4096 --max-token-len 8192 \
  --steps-of 8 --parts sft ppo --out "$2"; }
train() { python3 -m verl_engine train --device cuda --no-progress --output-dir "$1" "${@:2}" | tail -1; }
for part in "${@:2}"; do
case "$part" in
rl_step)
  for i in 1 2; do
    PYTHONPATH=$old step "$root/.old/benchmarks" "$out/rl_step_before_$i.json" | tail -1
    PYTHONPATH=$new step "$root/benchmarks" "$out/rl_step_after_$i.json" | tail -1
  done
  ;;
sft)
  PYTHONPATH=$old train /tmp/sft_before
  PYTHONPATH=$old_lr train /tmp/sft_before_lr
  PYTHONPATH=$new train /tmp/sft_after
  # the new code with the old weight-decay bug put back (every group decayed): isolates the fix
  PYTHONPATH=$new python3 - <<'PY' | tail -1
import sys

import verl_engine.optimizer as optimizer

fixed = optimizer.build_optimizer


def decay_everything(chunks, *, settings, debug, params_dtype):
    opt = fixed(chunks, settings=settings, debug=debug, params_dtype=params_dtype)
    for group in opt.param_groups:
        group["weight_decay"] = float(settings["weight_decay"])
    return opt


optimizer.build_optimizer = decay_everything  # role_optimizer looks it up in its module at call time
from verl_engine.apps.cli import main

sys.exit(main(["train", "--device", "cuda", "--no-progress", "--output-dir", "/tmp/sft_after_nofix"]))
PY
  for r in sft_before sft_before_lr sft_after sft_after_nofix; do cp /tmp/$r/metrics.jsonl "$out/${r}_gpu_metrics.jsonl"; done
  ;;
tests)
PYTHONPATH=$new timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_engine_no_host_sync.py tests/test_engine_optimizer.py 2>&1 | tail -25
  ;;
esac
done
