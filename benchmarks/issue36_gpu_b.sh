#!/usr/bin/env bash
# Issue 36, the next runs on one machine of 4 GPUs (one device command, about 9 minutes):
#   part 5 follow-up: NCCL collective bandwidth (NCCL_DEBUG=INFO names the transport and protocol; log kept), and
#   DP 4 of the 1.5B shape with NCCL_PROTO=Simple beside the default (the profile showed RING_LL all-gathers);
#   part 3: Megatron-FSDP's three sharding strategies vs DDP + distributed optimizer (run first, same lease), 1.5B
#   shape, 4 GPUs, the same PPO step and batch (targets mfsdp_4gpu_memory_ratio / mfsdp_4gpu_tokens_ratio from optim_grads_params);
#   part 5: the Qwen2.5-7B shape at sequence length 4096 on 4 GPUs, DP 4 + Megatron-FSDP (mfu_7b_4gpu).
# Usage (wheelhouse installed, PYTHONPATH set, BENCH_COMMIT the commit): bash benchmarks/issue36_gpu_b.sh TAG OUT
set -uo pipefail
TAG=${1:?tag, e.g. h200x4}; OUT=${2:?output dir}
cd "$(dirname "$0")"
RUN=(python3 -m torch.distributed.run --standalone --nproc-per-node 4)
mkdir -p "$OUT/results"
. ./_go.sh  # go LIMIT NAME CMD...
go_filter() { grep -v -i "warn" | grep -E '^\{|rror' | cut -c1-400 | tail -3; }  # JSON records and errors only
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH,TUNING timeout 90 "${RUN[@]}" nccl_bandwidth_gpu.py \
  --out "results/nccl_bandwidth_$TAG.json" > "$OUT/results/nccl_bandwidth_$TAG.log" 2>&1
cp "results/nccl_bandwidth_$TAG.json" "$OUT/results/" 2>/dev/null
grep -E '^\{' "$OUT/results/nccl_bandwidth_$TAG.log" | cut -c1-200
S=(--shape qwen2.5-1.5b --seq 4096 --steps 3 --warmup 1 --seqs-per-replica 16)
AM=actor_rollout_ref.actor.megatron
go 100 scaling_1.5b_dp4_b_$TAG "${RUN[@]}" scaling_gpu.py "${S[@]}" --out "results/scaling_1.5b_dp4_b_$TAG.json"
NCCL_PROTO=Simple go 100 scaling_1.5b_dp4_simple_$TAG "${RUN[@]}" scaling_gpu.py "${S[@]}" \
  --out "results/scaling_1.5b_dp4_simple_$TAG.json"
for strategy in optim optim_grads optim_grads_params; do
  target=()
  [ "$strategy" = optim_grads_params ] && target=(--target mfsdp_4gpu_memory_ratio:memory_ratio
    --target mfsdp_4gpu_tokens_ratio:tokens_ratio)
  go 110 "mfsdp_1.5b_${strategy}_$TAG" "${RUN[@]}" scaling_gpu.py "${S[@]}" \
    --versus "results/scaling_1.5b_dp4_b_$TAG.json" "${target[@]}" --out "results/mfsdp_1.5b_${strategy}_$TAG.json" \
    --override "$AM.use_megatron_fsdp=true" "+$AM.override_ddp_config.data_parallel_sharding_strategy=$strategy"
done
go 200 "mfu_7b_dp4_mfsdp_$TAG" "${RUN[@]}" scaling_gpu.py --shape qwen2.5-7b --seq 4096 --steps 3 --warmup 1 \
  --seqs-per-replica 8 --target mfu_7b_4gpu:mfu --out "results/mfu_7b_dp4_mfsdp_$TAG.json" \
  --override "$AM.use_megatron_fsdp=true" "+$AM.override_ddp_config.data_parallel_sharding_strategy=optim_grads_params"
ls -l "$OUT/results"
