#!/usr/bin/env bash
# GPU smoke benchmark of `verl-engine train` (run on the lent GPU machine, see README "GPU runs").
# Usage: bash benchmarks/gpu_train.sh OUT_DIR [NGPUS]   (wheelhouse/ must have been built and carried)
set -euo pipefail
OUT=${1:?output dir}; NGPU=${2:-$(nvidia-smi -L | wc -l)}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site wheelhouse/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpus.txt"
ARGS=(--preset base --steps 60 --global-batch-size 64 --micro-batch-size 8 --seq-len 256 --no-progress)
python3 -m verl_engine train "${ARGS[@]}" --output-dir "$OUT/gpu1" 2>&1 | grep -v -i warn | tee "$OUT/gpu1.log"
if [ "$NGPU" -ge 2 ]; then
  torchrun --standalone --nproc-per-node 2 -m verl_engine train "${ARGS[@]}" --output-dir "$OUT/gpu2" 2>&1 \
    | grep -v -i warn | tee "$OUT/gpu2.log"
  torchrun --standalone --nproc-per-node 2 -m verl_engine train "${ARGS[@]}" --output-dir "$OUT/gpu2_nodistopt" \
    megatron.use_distributed_optimizer=false 2>&1 | grep -v -i warn | tee "$OUT/gpu2_nodistopt.log"
fi
