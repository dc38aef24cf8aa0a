#!/usr/bin/env bash
# Issue 36, part 3 on 4 GPUs (one device command, about 8 minutes; everything packed into OUT/issue36_f.tgz):
# Megatron-FSDP optim_grads_params against DDP + distributed optimizer, 1.5B shape, Triton LM head.
#   - four sequences per micro-batch (16384 tokens) with full activation recompute: a quarter of ZeRO-3's
#     traffic per token, and activations small enough that the sharded states decide the peak;
#   - gradient precision like for like: the DDP runs reduce in bf16 (megatron-core's default,
#     grad_reduce_in_fp32=false), while verl-mfsdp's default keeps fp32 main gradients and reduce-scatters
#     them in fp32 (twice the bytes). Both FSDP settings run; targets mfsdp_4gpu_memory_ratio /
#     _tokens_ratio come from the bf16 one, the comparison with the same precision as its DDP reference;
#   - the bf16 FSDP setting also at one sequence per micro-batch (the earlier runs' layout, no recompute),
#     to separate the gradient dtype's share from the micro-batch size's.
# Usage (wheelhouse installed, PYTHONPATH set, BENCH_COMMIT the commit): bash benchmarks/issue36_gpu_f.sh TAG OUT
set -uo pipefail
. "$(dirname "$0")/_issue36.sh" issue36_f "$@"  # TAG OUT; RUN, go, OVERLAP, FSDP, BF16, DDP
S=(--shape qwen2.5-1.5b --seq 4096 --steps 3 --warmup 1 --seqs-per-replica 16 --fused-kernels)
M=("${S[@]}" --max-token-len 16384 --recompute)
DDP16="results/scaling_1.5b_dp4_mt16k_recompute_$TAG.json"
go 110 "scaling_1.5b_dp4_mt16k_recompute_$TAG" "${RUN[@]}" --nproc-per-node 4 scaling_gpu.py "${M[@]}" --out "$DDP16" \
  --override "${DDP[@]}"
go 130 "mfsdp_1.5b_optim_grads_params_mt16k_recompute_$TAG" "${RUN[@]}" --nproc-per-node 4 scaling_gpu.py "${M[@]}" --versus "$DDP16" \
  --out "results/mfsdp_1.5b_optim_grads_params_mt16k_recompute_$TAG.json" --override "${FSDP[@]}"
go 130 "mfsdp_1.5b_optim_grads_params_bf16grads_mt16k_recompute_$TAG" "${RUN[@]}" --nproc-per-node 4 scaling_gpu.py "${M[@]}" \
  --versus "$DDP16" --out "results/mfsdp_1.5b_optim_grads_params_bf16grads_mt16k_recompute_$TAG.json" \
  --target mfsdp_4gpu_memory_ratio:memory_ratio --target mfsdp_4gpu_tokens_ratio:tokens_ratio \
  --override "${FSDP[@]}" "${BF16[@]}"
go 110 "mfsdp_1.5b_optim_grads_params_bf16grads_$TAG" "${RUN[@]}" --nproc-per-node 4 scaling_gpu.py "${S[@]}" \
  --out "results/mfsdp_1.5b_optim_grads_params_bf16grads_$TAG.json" --override "${FSDP[@]}" "${BF16[@]}"
cp results/targets.json "$OUT/results/"
ls -l "$OUT/results"
