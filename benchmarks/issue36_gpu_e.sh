#!/usr/bin/env bash
# Issue 36, part 5, the next runs on 4 GPUs (one device command, about 6 minutes; everything packed into
# OUT/issue36_e.tgz), Triton LM head throughout: data-parallel scaling of the 1.5B shape with a baseline that
# has its own spread: DP 1 twice, and once with one OpenMP thread as torchrun gives the DP 2 / 4 ranks (the best of
# the three is the baseline), DP 2, DP 4 with overlap_grad_reduce + overlap_param_gather twice; best_target.py
# stores the better DP 4 efficiency. Part 3 is issue36_gpu_f.sh. Use a new TAG per lease (the records' names).
# Usage (wheelhouse installed, PYTHONPATH set, BENCH_COMMIT the commit): bash benchmarks/issue36_gpu_e.sh TAG OUT
set -uo pipefail
. "$(dirname "$0")/_issue36.sh" issue36_e "$@"  # TAG OUT; RUN, go, OVERLAP, FSDP, BF16, DDP
S=(--shape qwen2.5-1.5b --seq 4096 --steps 4 --warmup 2 --seqs-per-replica 16 --fused-kernels)
for i in a b; do
  go 90 "scaling_1.5b_dp1_fused_${i}_$TAG" "${RUN[@]}" --nproc-per-node 1 scaling_gpu.py "${S[@]}" \
    --out "results/scaling_1.5b_dp1_fused_${i}_$TAG.json" --override "${BF16[@]}"
done
# torchrun gives each of several processes one OpenMP thread, a lone process one per core: the DP 1 run with the
# DP 2 / 4 ranks' thread count as well (on 4 x H200 at 3a365bb a lone process ran at half a DP 4 rank's speed)
OMP_NUM_THREADS=1 go 90 "scaling_1.5b_dp1_fused_omp1_$TAG" "${RUN[@]}" --nproc-per-node 1 scaling_gpu.py "${S[@]}" \
  --out "results/scaling_1.5b_dp1_fused_omp1_$TAG.json" --override "${BF16[@]}"
BASE=$(python3 -c "import json,sys; r=[(json.load(open(f))['tokens_per_s'], f) for f in sys.argv[1:]]; print(max(r)[1])" \
  "results/scaling_1.5b_dp1_fused_a_$TAG.json" "results/scaling_1.5b_dp1_fused_b_$TAG.json" \
  "results/scaling_1.5b_dp1_fused_omp1_$TAG.json")
echo "baseline: $BASE"
go 90 "scaling_1.5b_dp2_fused_overlap_$TAG" "${RUN[@]}" --nproc-per-node 2 scaling_gpu.py "${S[@]}" --baseline "$BASE" \
  --out "results/scaling_1.5b_dp2_fused_overlap_$TAG.json" --override "${DDP[@]}"
for i in a b; do
  go 90 "scaling_1.5b_dp4_fused_overlap_${i}_$TAG" "${RUN[@]}" --nproc-per-node 4 scaling_gpu.py "${S[@]}" \
    --baseline "$BASE" --out "results/scaling_1.5b_dp4_fused_overlap_${i}_$TAG.json" --override "${DDP[@]}"
done
python3 best_target.py --key dp4_scaling_efficiency --metric scaling_efficiency \
  "results/scaling_1.5b_dp4_fused_overlap_a_$TAG.json" "results/scaling_1.5b_dp4_fused_overlap_b_$TAG.json"
cp results/targets.json "$OUT/results/"
ls -l "$OUT/results"
