#!/usr/bin/env bash
# Issue 36, part 3: is Megatron-FSDP's extra transient memory (about 2.5 GiB at the 1.5B shape, the same at DP 2
# and DP 4, and not moved by the communication unit: issue36_gpu_h.sh at 2 GPUs) the whole bf16 model that
# megatron-core all-gathers after every optimizer step? With overlap_param_gather false, the distributed
# optimizer's step_with_ready_grads calls start_param_sync(), which gathers every bucket and keeps each until its
# layer's forward releases it; with it true only the first bucket is prefetched. A/B on one machine: verl-mfsdp's
# settings as they are, then with overlap_param_gather=true. GPUS (default 4) GPUs, 16K-token micro-batches with
# recompute as issue36_gpu_h.sh. Usage (wheelhouse installed, PYTHONPATH set, BENCH_COMMIT the commit):
# GPUS=2 bash benchmarks/issue36_gpu_k.sh TAG OUT
set -uo pipefail
. "$(dirname "$0")/_issue36.sh" issue36_k "$@"  # TAG OUT; RUN, go, OVERLAP, FSDP, BF16, GPUS
M=("${STEP16K[@]}" --steps 3 --warmup 1)
go 130 "mfsdp_1.5b_ogp_bf16grads_mt16k_dp${GPUS}_$TAG" "${RUN[@]}" --nproc-per-node "$GPUS" scaling_gpu.py "${M[@]}" \
  --out "results/mfsdp_1.5b_ogp_bf16grads_mt16k_dp${GPUS}_$TAG.json" --override "${FSDP[@]}" "${BF16[@]}"
go 130 "mfsdp_1.5b_ogp_bf16grads_mt16k_paramoverlap_dp${GPUS}_$TAG" "${RUN[@]}" --nproc-per-node "$GPUS" scaling_gpu.py \
  "${M[@]}" --versus "results/mfsdp_1.5b_ogp_bf16grads_mt16k_dp${GPUS}_$TAG.json" \
  --out "results/mfsdp_1.5b_ogp_bf16grads_mt16k_paramoverlap_dp${GPUS}_$TAG.json" --override "${FSDP[@]}" "${BF16[@]}" \
  "+$AM.override_ddp_config.overlap_param_gather=true"
ls -l "$OUT/results"
