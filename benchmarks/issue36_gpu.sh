#!/usr/bin/env bash
# Issue 36's benchmarks on one machine of 4 GPUs, in one device command (about 9 minutes):
#   part 5, data parallel scaling of the 1.5B shape (DP 1 -> 2 -> 4, 16 sequences of 4096 tokens per replica);
#   part 2, pipeline stages vs data parallel on 2 GPUs (PP 2 vs DP 2, the same 32-sequence global batch);
#   part 4, dynamic CP on Megatron-LM's dynamic-CP workload (12 layers, hidden 2048, lognormal lengths of mean
#   1024 clipped to 128..8192, 2048 tokens per rank) vs static CP 4, 3 repeats in turn, and the one-GPU run
#   that measures the ideal-balance bound.
# Usage (wheelhouse installed, PYTHONPATH set, BENCH_COMMIT the commit): bash benchmarks/issue36_gpu.sh TAG OUT
# Records go to benchmarks/results/ (targets.json updated by the scripts) and are copied to OUT.
set -uo pipefail
TAG=${1:?tag, e.g. h200x4}; OUT=${2:?output dir}
cd "$(dirname "$0")"
RUN=(python3 -m torch.distributed.run --standalone)
S=(--shape qwen2.5-1.5b --seq 4096 --steps 3 --warmup 1)
mkdir -p "$OUT/results"
. ./_go.sh  # go LIMIT NAME CMD...
go 100 scaling_1.5b_dp1_$TAG "${RUN[@]}" --nproc-per-node 1 scaling_gpu.py "${S[@]}" --seqs-per-replica 16 \
  --out results/scaling_1.5b_dp1_$TAG.json
go 100 scaling_1.5b_dp2_$TAG "${RUN[@]}" --nproc-per-node 2 scaling_gpu.py "${S[@]}" --seqs-per-replica 16 \
  --baseline results/scaling_1.5b_dp1_$TAG.json --out results/scaling_1.5b_dp2_$TAG.json
go 110 scaling_1.5b_dp4_$TAG "${RUN[@]}" --nproc-per-node 4 scaling_gpu.py "${S[@]}" --seqs-per-replica 16 \
  --baseline results/scaling_1.5b_dp1_$TAG.json --target dp4_scaling_efficiency:scaling_efficiency --out results/scaling_1.5b_dp4_$TAG.json
go 100 scaling_1.5b_pp2_$TAG "${RUN[@]}" --nproc-per-node 2 scaling_gpu.py "${S[@]}" --seqs-per-replica 32 --pp 2 \
  --out results/scaling_1.5b_pp2_$TAG.json
D=(--preset 1b --layers 12 --vocab 32000 --mean 1024 --sigma 1.0 --min-len 128 --max-len 8192
   --tokens-per-step 65536 --steps 5 --warmup 1)
go 80 dyncp_megatron_workload_1gpu_$TAG "${RUN[@]}" --nproc-per-node 1 dyncp_longtail.py "${D[@]}" \
  --tokens-per-rank 8192 --layouts none --repeats 2 --out results/dyncp_megatron_workload_1gpu_$TAG.json
go 200 dyncp_megatron_workload_$TAG "${RUN[@]}" --nproc-per-node 4 dyncp_longtail.py "${D[@]}" \
  --tokens-per-rank 2048 --max-seqlen 2048 --layouts static4,dynamic --repeats 3 --targets \
  --ideal-from results/dyncp_megatron_workload_1gpu_$TAG.json --out results/dyncp_megatron_workload_$TAG.json
ls -l "$OUT/results"
