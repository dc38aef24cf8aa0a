#!/usr/bin/env bash
# Issue 36, part 3 at the 7B shape: Megatron-FSDP optim_grads_params (bf16 reduce, verl-mfsdp's two-unit
# communication size) against DDP + distributed optimizer on 4 GPUs, 16K-token micro-batches with recompute, the
# Qwen2.5-7B shape at sequence length 4096. At 7B the sharded state is most of the peak (DDP: about 53 GB of
# parameters, gradients and sharded optimizer state per GPU; Megatron-FSDP: about 30 GB), so this is where the
# 0.6x memory goal can show. One device command (about 4 minutes; everything packed into OUT/issue36_j.tgz).
# MAXTOK (environment, default 16384): the micro-batch token budget. The states are 0.57 of DDP's and both
# layouts add the same activations, so a smaller budget (8192) moves the memory ratio towards 0.57 and costs
# Megatron-FSDP overlap (twice the parameter traffic per token); record names carry it (mt16k, mt8k).
# Needs H200s: the DDP run does not fit an 80 GB H100.
# Usage (wheelhouse installed, PYTHONPATH set, BENCH_COMMIT the commit): bash benchmarks/issue36_gpu_j.sh TAG OUT
set -uo pipefail
. "$(dirname "$0")/_issue36.sh" issue36_j "$@"  # TAG OUT; RUN, go, OVERLAP, FSDP, BF16, DDP
MAXTOK=${MAXTOK:-16384}; MT="mt$((MAXTOK / 1024))k"
M=(--shape qwen2.5-7b --seq 4096 --steps 3 --warmup 1 --seqs-per-replica 16 --fused-kernels --max-token-len "$MAXTOK" --recompute)
DDP16="results/scaling_7b_dp4_${MT}_recompute_$TAG.json"
go 200 "scaling_7b_dp4_${MT}_recompute_$TAG" "${RUN[@]}" --nproc-per-node 4 scaling_gpu.py "${M[@]}" --out "$DDP16" \
  --override "${DDP[@]}"
go 200 "mfsdp_7b_ogp_bf16grads_${MT}_unit2_$TAG" "${RUN[@]}" --nproc-per-node 4 scaling_gpu.py "${M[@]}" --versus "$DDP16" \
  --out "results/mfsdp_7b_ogp_bf16grads_${MT}_unit2_$TAG.json" --override "${FSDP[@]}" "${BF16[@]}"
ls -l "$OUT/results"
