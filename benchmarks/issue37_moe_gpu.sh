#!/usr/bin/env bash
# Issue 37 part 6: a Qwen3-30B-A3B shape with 8 of its 48 layers (128 experts, top 8, grouped experts) on 4 GPUs
# with expert parallelism 4, trained on verl's 1K-16K long tail (lognormal, median 2048, sigma 1.0, clipped to
# 1024..16384; 131072 tokens per step): tokens/s, MFU counting active parameters, peak memory, for static CP 4 and
# dynamic CP (max 8192 tokens per rank), 2 repeats in turn. Then (issue 36 part 4) one profiled extra step of
# dynamic CP and static CP 4 on Megatron-LM's dynamic-CP workload (BENCH_PROFILE_DIR: operator tables per rank).
# Usage (wheelhouse installed, PYTHONPATH set, BENCH_COMMIT the commit): bash benchmarks/issue37_moe_gpu.sh TAG OUT
set -uo pipefail
TAG=${1:?tag, e.g. h200x4}; OUT=${2:?output dir}
cd "$(dirname "$0")"
RUN=(python3 -m torch.distributed.run --standalone --nproc-per-node 4)
mkdir -p "$OUT/results" "$OUT/profile"
. ./_go.sh  # go LIMIT NAME CMD...
go 330 moe_qwen3_30b_a3b_ep4_$TAG "${RUN[@]}" dyncp_longtail.py --model qwen3-30b-a3b --layers 8 --ep 4 \
  --median 2048 --sigma 1.0 --min-len 1024 --max-len 16384 --tokens-per-step 131072 --steps 4 --warmup 1 \
  --tokens-per-rank 8192 --max-seqlen 8192 --layouts static4,dynamic --repeats 2 \
  --out results/moe_qwen3_30b_a3b_ep4_$TAG.json
BENCH_PROFILE_DIR=$OUT/profile go 200 dyncp_megatron_workload_profiled_$TAG "${RUN[@]}" dyncp_longtail.py \
  --preset 1b --layers 12 --vocab 32000 --mean 1024 --sigma 1.0 --min-len 128 --max-len 8192 \
  --tokens-per-step 65536 --steps 3 --warmup 1 --tokens-per-rank 2048 --max-seqlen 2048 \
  --layouts static4,dynamic --out results/dyncp_megatron_workload_profiled_$TAG.json
ls -l "$OUT/results" "$OUT/profile"
