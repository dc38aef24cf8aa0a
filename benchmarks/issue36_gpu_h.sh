#!/usr/bin/env bash
# Issue 36, part 3: Megatron-FSDP's memory after verl-mfsdp sizes the reduce-scatter queue and the all-gather
# prefetch to two FSDP units (verl_mfsdp.settings.fsdp_communication_unit_size) instead of megatron-core's
# at-least-1e9-elements default. GPUS (default 4) GPUs, one device command (about 4 minutes; everything packed into
# OUT/issue36_h.tgz), 16K-token micro-batches with recompute as issue36_gpu_f.sh: DDP + distributed optimizer;
# Megatron-FSDP bf16 reduce with the new default (sets the targets); the same with megatron-core's default
# (suggested_communication_unit_size=1e9: the A/B); Megatron-FSDP with verl-mfsdp's fp32 reduce. VARIANTS (environment,
# default "unit1e9 fp32"): which of the last two run; VARIANTS="" runs only the two that set the targets.
# Usage (wheelhouse installed, PYTHONPATH set, BENCH_COMMIT the commit): bash benchmarks/issue36_gpu_h.sh TAG OUT
set -uo pipefail
. "$(dirname "$0")/_issue36.sh" issue36_h "$@"  # TAG OUT; RUN, go, OVERLAP, FSDP, BF16, DDP
TARGETS=()
[ "$GPUS" = 4 ] && TARGETS=(--target mfsdp_4gpu_memory_ratio:memory_ratio --target mfsdp_4gpu_tokens_ratio:tokens_ratio)
MCORE_UNIT=("+$AM.override_ddp_config.suggested_communication_unit_size=1000000000")
M=("${STEP16K[@]}" --steps 3 --warmup 1)
DDP16="results/scaling_1.5b_dp${GPUS}_mt16k_recompute_unit_$TAG.json"
go 110 "scaling_1.5b_dp${GPUS}_mt16k_recompute_unit_$TAG" "${RUN[@]}" --nproc-per-node "$GPUS" scaling_gpu.py "${M[@]}" --out "$DDP16" \
  --override "${DDP[@]}"
go 130 "mfsdp_1.5b_ogp_bf16grads_mt16k_unit2_$TAG" "${RUN[@]}" --nproc-per-node "$GPUS" scaling_gpu.py "${M[@]}" --versus "$DDP16" \
  --out "results/mfsdp_1.5b_ogp_bf16grads_mt16k_unit2_$TAG.json" \
  "${TARGETS[@]}" \
  --override "${FSDP[@]}" "${BF16[@]}"
VARIANTS=${VARIANTS-unit1e9 fp32}
[[ " $VARIANTS " == *" unit1e9 "* ]] && go 130 "mfsdp_1.5b_ogp_bf16grads_mt16k_unit1e9_$TAG" "${RUN[@]}" --nproc-per-node "$GPUS" scaling_gpu.py "${M[@]}" --versus "$DDP16" \
  --out "results/mfsdp_1.5b_ogp_bf16grads_mt16k_unit1e9_$TAG.json" --override "${FSDP[@]}" "${BF16[@]}" "${MCORE_UNIT[@]}"
[[ " $VARIANTS " == *" fp32 "* ]] && go 130 "mfsdp_1.5b_ogp_fp32grads_mt16k_unit2_$TAG" "${RUN[@]}" --nproc-per-node "$GPUS" scaling_gpu.py "${M[@]}" --versus "$DDP16" \
  --out "results/mfsdp_1.5b_ogp_fp32grads_mt16k_unit2_$TAG.json" --override "${FSDP[@]}"
[ "$GPUS" = 4 ] && cp results/targets.json "$OUT/results/"
ls -l "$OUT/results"
