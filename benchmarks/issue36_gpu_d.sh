#!/usr/bin/env bash
# Issue 36, parts 3 and 5 with the Triton LM head (--fused-kernels), one device command on 4 GPUs (about 7
# minutes), every record and profile packed into OUT/issue36_d.tgz (a device command returns few files):
#   part 5: the Qwen2.5-7B shape at 4096 tokens, 16 sequences per replica, DP 4 with DDP + distributed optimizer
#     (mfu_7b_4gpu; issue36_gpu_c.sh measured Megatron-FSDP optim_grads_params slower on the same lease);
#   part 5: the 1.5B shape at DP 1 and DP 4 (weak scaling, 16 sequences per replica), DP 4 twice: as built, and
#     with overlap_grad_reduce + overlap_param_gather; best_target.py stores the better as dp4_scaling_efficiency;
#   part 3: Megatron-FSDP optim_grads_params against that DP 4 run (mfsdp_4gpu_memory_ratio, _tokens_ratio).
# DP 4 and Megatron-FSDP run one extra profiled step (GPU timeline and kernel tables under OUT/profiles).
# Usage (wheelhouse installed, PYTHONPATH set, BENCH_COMMIT the commit): bash benchmarks/issue36_gpu_d.sh TAG OUT
set -uo pipefail
TAG=${1:?tag, e.g. h200x4}; OUT=${2:?output dir}
cd "$(dirname "$0")"
RUN=(python3 -m torch.distributed.run --standalone --nproc-per-node 4)
mkdir -p "$OUT/results" "$OUT/profiles"
. ./_go.sh  # go LIMIT NAME CMD...
go_filter() { grep -v -i "warn" | grep -E '^\{|rror' | cut -c1-300 | tail -3; }  # JSON records and errors only
trap 'tar czf "$OUT/issue36_d.tgz" -C "$OUT" results profiles; rm -rf "$OUT/results" "$OUT/profiles"' EXIT
AM=actor_rollout_ref.actor.megatron
go 160 "mfu_7b_dp4_ddp_fused_$TAG" "${RUN[@]}" scaling_gpu.py --shape qwen2.5-7b --seq 4096 --steps 3 --warmup 1 \
  --seqs-per-replica 16 --fused-kernels --target mfu_7b_4gpu:mfu --out "results/mfu_7b_dp4_ddp_fused_$TAG.json"
S=(--shape qwen2.5-1.5b --seq 4096 --steps 3 --warmup 1 --seqs-per-replica 16 --fused-kernels)
go 80 "scaling_1.5b_dp1_fused_$TAG" python3 -m torch.distributed.run --standalone --nproc-per-node 1 scaling_gpu.py \
  "${S[@]}" --out "results/scaling_1.5b_dp1_fused_$TAG.json"
export BENCH_PROFILE_DIR="$OUT/profiles"
B=(--baseline "results/scaling_1.5b_dp1_fused_$TAG.json")
go 90 "scaling_1.5b_dp4_fused_$TAG" "${RUN[@]}" scaling_gpu.py "${S[@]}" "${B[@]}" \
  --out "results/scaling_1.5b_dp4_fused_$TAG.json"
go 90 "scaling_1.5b_dp4_fused_overlap_$TAG" "${RUN[@]}" scaling_gpu.py "${S[@]}" "${B[@]}" \
  --out "results/scaling_1.5b_dp4_fused_overlap_$TAG.json" \
  --override "+$AM.override_ddp_config.overlap_grad_reduce=true" "+$AM.override_ddp_config.overlap_param_gather=true"
python3 best_target.py --key dp4_scaling_efficiency --metric scaling_efficiency \
  "results/scaling_1.5b_dp4_fused_$TAG.json" "results/scaling_1.5b_dp4_fused_overlap_$TAG.json" \
  && cp results/targets.json "$OUT/results/"
go 110 "mfsdp_1.5b_optim_grads_params_fused_$TAG" "${RUN[@]}" scaling_gpu.py "${S[@]}" \
  --versus "results/scaling_1.5b_dp4_fused_$TAG.json" --out "results/mfsdp_1.5b_optim_grads_params_fused_$TAG.json" \
  --target mfsdp_4gpu_memory_ratio:memory_ratio --target mfsdp_4gpu_tokens_ratio:tokens_ratio \
  --override "$AM.use_megatron_fsdp=true" "+$AM.override_ddp_config.data_parallel_sharding_strategy=optim_grads_params"
grep -h 'GPU timeline' "$OUT"/profiles/*rank0.txt
ls -l "$OUT/results"
