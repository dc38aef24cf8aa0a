#!/usr/bin/env bash
# Issue 36, part 5: why the one-GPU baseline of the DP scaling runs is slow and noisy (15.8K tokens/s, steps of
# 3.4-4.5 s, against 29K per GPU at DP 4 on the same lease). One GPU, one device command (about 5 minutes;
# everything packed into OUT/issue36_g.tgz): DP 1 as issue36_gpu_e.sh runs it, profiled (torch profiler tables
# and GPU timeline); DP 1 with the DP 4 runs' overlap flags (the one setting that differed); DP 1 at 16K-token
# micro-batches with recompute, twice, the baseline for issue36_gpu_f.sh's DP 4 record of the same work.
# Usage (wheelhouse installed, PYTHONPATH set, BENCH_COMMIT the commit): bash benchmarks/issue36_gpu_g.sh TAG OUT
set -uo pipefail
. "$(dirname "$0")/_issue36.sh" issue36_g "$@"  # TAG OUT; RUN, go, OVERLAP, FSDP, BF16, DDP
trap 'cp -r /tmp/prof "$OUT/results/" 2>/dev/null; tar czf "$OUT/issue36_g.tgz" -C "$OUT" results; rm -rf "$OUT/results"' EXIT
S=(--shape qwen2.5-1.5b --seq 4096 --steps 4 --warmup 2 --seqs-per-replica 16 --fused-kernels)
BENCH_PROFILE_DIR=/tmp/prof go 110 "scaling_1.5b_dp1_fused_profiled_$TAG" "${RUN[@]}" --nproc-per-node 1 scaling_gpu.py "${S[@]}" \
  --out "results/scaling_1.5b_dp1_fused_profiled_$TAG.json" --override "${BF16[@]}"
go 90 "scaling_1.5b_dp1_fused_overlap_$TAG" "${RUN[@]}" --nproc-per-node 1 scaling_gpu.py "${S[@]}" \
  --out "results/scaling_1.5b_dp1_fused_overlap_$TAG.json" --override "${DDP[@]}"
M=(--shape qwen2.5-1.5b --seq 4096 --steps 3 --warmup 1 --seqs-per-replica 16 --fused-kernels --max-token-len 16384 --recompute)
for i in a b; do
  go 100 "scaling_1.5b_dp1_mt16k_recompute_${i}_$TAG" "${RUN[@]}" --nproc-per-node 1 scaling_gpu.py "${M[@]}" \
    --out "results/scaling_1.5b_dp1_mt16k_recompute_${i}_$TAG.json" --override "${DDP[@]}"
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
ls -l "$OUT/results"
