#!/usr/bin/env bash
# Megatron-FSDP vs DDP + distributed optimizer through `verl-engine train`, ~1B-parameter Qwen2 (preset 1b,
# 1.06B parameters with the engine's 128-token vocabulary), bf16, on 2 and 4 GPUs (run on the lent GPU machine).
# Usage: bash benchmarks/mfsdp_1b.sh OUT_DIR "2 4"     (wheelhouse/ built, carried and installed, PYTHONPATH set)
# Same data, seed and batch for every run: 32 sequences x 1024 tokens per step, micro-batch 4 per GPU,
# 8 steps; tokens/s averages the steps after the first; peak memory is torch.cuda.max_memory_allocated on rank 0.
set -euo pipefail
OUT=${1:?output dir}; GPUS=${2:-"2 4"}
mkdir -p "$OUT"
ARGS=(--preset 1b --steps 8 --global-batch-size 32 --micro-batch-size 4 --seq-len 1024 --no-progress)
for n in $GPUS; do
  for variant in ddp optim optim_grads optim_grads_params; do
    if [ "$variant" = ddp ]; then
      EXTRA=(megatron.use_distributed_optimizer=true)
    else
      EXTRA=(megatron.use_megatron_fsdp=true "megatron.override_ddp_config.data_parallel_sharding_strategy=$variant")
    fi
    torchrun --standalone --nproc-per-node "$n" -m verl_engine train "${ARGS[@]}" \
      --output-dir "$OUT/gpu${n}_${variant}" "${EXTRA[@]}" 2>&1 | grep -v -i warn | tail -4 \
      | tee "$OUT/gpu${n}_${variant}.log"
  done
done
