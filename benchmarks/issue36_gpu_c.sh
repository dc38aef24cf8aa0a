#!/usr/bin/env bash
# Issue 36, parts 3, 4, 5 on one machine of 4 GPUs (one device command, about 8 minutes): where the time goes.
#   part 5: the Qwen2.5-7B shape at 4096 tokens, 16 sequences per replica, with the Triton LM head
#     (--fused-kernels), in two layouts: DDP + distributed optimizer, and Megatron-FSDP optim_grads_params;
#     best_target.py stores the better one as mfu_7b_4gpu;
#   part 3: the 1.5B shape, DDP + distributed optimizer vs Megatron-FSDP optim_grads_params, Triton LM head,
#     each with one extra profiled step (BENCH_PROFILE_DIR): the GPU timeline (idle, exposed NCCL, compute);
#   part 4: Megatron-LM's dynamic-CP workload, static CP 4 and dynamic CP, one repeat, with a cProfile of the
#     host over one extra step (BENCH_PROFILE_KIND=python): what a host-bound micro-batch spends its time on.
# Usage (wheelhouse installed, PYTHONPATH set, BENCH_COMMIT the commit): bash benchmarks/issue36_gpu_c.sh TAG OUT
set -uo pipefail
TAG=${1:?tag, e.g. h200x4}; OUT=${2:?output dir}
cd "$(dirname "$0")"
RUN=(python3 -m torch.distributed.run --standalone --nproc-per-node 4)
mkdir -p "$OUT/results" "$OUT/profiles"
. ./_go.sh  # go LIMIT NAME CMD...
go_filter() { grep -v -i "warn" | grep -E '^\{|rror' | cut -c1-600 | tail -3; }  # JSON records and errors only
AM=actor_rollout_ref.actor.megatron
FSDP=("$AM.use_megatron_fsdp=true" "+$AM.override_ddp_config.data_parallel_sharding_strategy=optim_grads_params")
S7=(--shape qwen2.5-7b --seq 4096 --steps 3 --warmup 1 --seqs-per-replica 16 --fused-kernels)
go 150 "mfu_7b_dp4_ddp_fused_$TAG" "${RUN[@]}" scaling_gpu.py "${S7[@]}" --out "results/mfu_7b_dp4_ddp_fused_$TAG.json"
go 150 "mfu_7b_dp4_mfsdp_fused_$TAG" "${RUN[@]}" scaling_gpu.py "${S7[@]}" \
  --out "results/mfu_7b_dp4_mfsdp_fused_$TAG.json" --override "${FSDP[@]}"
python3 best_target.py --key mfu_7b_4gpu --metric mfu "results/mfu_7b_dp4_ddp_fused_$TAG.json" \
  "results/mfu_7b_dp4_mfsdp_fused_$TAG.json" && cp results/targets.json "$OUT/results/"
S=(--shape qwen2.5-1.5b --seq 4096 --steps 3 --warmup 1 --seqs-per-replica 16 --fused-kernels)
export BENCH_PROFILE_DIR="$OUT/profiles"
go 100 "scaling_1.5b_dp4_fused_$TAG" "${RUN[@]}" scaling_gpu.py "${S[@]}" --out "results/scaling_1.5b_dp4_fused_$TAG.json"
go 110 "mfsdp_1.5b_optim_grads_params_fused_$TAG" "${RUN[@]}" scaling_gpu.py "${S[@]}" \
  --versus "results/scaling_1.5b_dp4_fused_$TAG.json" --out "results/mfsdp_1.5b_optim_grads_params_fused_$TAG.json" \
  --override "${FSDP[@]}"
D=(--preset 1b --layers 12 --vocab 32000 --mean 1024 --sigma 1.0 --min-len 128 --max-len 8192
   --tokens-per-step 65536 --steps 4 --warmup 1)
BENCH_PROFILE_KIND=python go 120 "dyncp_megatron_workload_pyprof_$TAG" "${RUN[@]}" dyncp_longtail.py "${D[@]}" \
  --tokens-per-rank 2048 --max-seqlen 2048 --layouts static4,dynamic --out "results/dyncp_megatron_workload_pyprof_$TAG.json"
grep -h 'GPU timeline' "$OUT"/profiles/*rank0.txt
ls -l "$OUT/results" "$OUT/profiles"
