#!/usr/bin/env bash
# Issue 36 part 4 alone: dynamic CP on Megatron-LM's dynamic-CP workload (12 layers, hidden 2048, lognormal lengths
# of mean 1024 clipped to 128..8192, 2048 tokens per rank) vs static CP 4, 3 repeats in turn, and the one-GPU run
# that measures the ideal-balance bound (about 5 minutes on 4 GPUs; the same runs as issue36_gpu.sh's part 4).
# Usage (wheelhouse installed, PYTHONPATH set, BENCH_COMMIT the commit): bash benchmarks/issue36_dyncp_gpu.sh TAG OUT
# LAYOUTS (default static4,dynamic; e.g. static4,dynamic+graph1,dynamic+graph: CUDA graphs of the decoder for the
# CP-1 micro-batches only, or for every CP size), TARGET_LAYOUT (the layout whose speedup goes to targets.json,
# default dynamic), LIMIT (seconds of the 4-GPU run, default 240), SAME_BUDGET (below), BOUND_TAG (the tag of the
# one-GPU bound records, default TAG: a one-GPU machine of the same GPU type may measure them, e.g. h200x1).
set -uo pipefail
TAG=${1:?tag, e.g. h200x4}; OUT=${2:?output dir}
cd "$(dirname "$0")"
RUN=(python3 -m torch.distributed.run --standalone)
mkdir -p "$OUT/results"
. ./_go.sh  # go LIMIT NAME CMD...
D=(--preset 1b --layers 12 --vocab 32000 --mean 1024 --sigma 1.0 --min-len 128 --max-len 8192
   --tokens-per-step 65536 --steps 5 --warmup 1)
# PARTS (default bounds,ab): "bounds" runs the one-GPU records, "ab" the 4-GPU A/B that reads them from results/;
# with graphs on both sides the two do not fit one 10-minute command: run PARTS=bounds, copy its records into
# benchmarks/results/ (they travel with the tree), then PARTS=ab.
PARTS=${PARTS:-bounds,ab}
BOUND_TAG=${BOUND_TAG:-$TAG}
IDEAL=results/dyncp_megatron_workload_1gpu_$BOUND_TAG.json
BUDGET=results/dyncp_megatron_workload_1gpu_budget_$BOUND_TAG.json
if [[ ,$PARTS, == *,bounds,* ]]; then
  # the ideal bound: one GPU at the pool budget (8192-token micro-batches), eager and graphed, its fastest x 4
  go 170 dyncp_megatron_workload_1gpu_$BOUND_TAG "${RUN[@]}" --nproc-per-node 1 dyncp_longtail.py "${D[@]}" \
    --tokens-per-rank 8192 --layouts none,none+graph --repeats 3 --out "$IDEAL"
  # SAME_BUDGET=1: also one GPU at the per-rank budget (2048-token micro-batches, eager and graphed), the bound
  # that perfect balance without communication would give within the budget (about 3 more minutes).
  if [ -n "${SAME_BUDGET:-}" ]; then
    go 200 dyncp_megatron_workload_1gpu_budget_$BOUND_TAG "${RUN[@]}" --nproc-per-node 1 dyncp_longtail.py "${D[@]}" \
      --tokens-per-rank 2048 --layouts none,none+graph --repeats 3 --out "$BUDGET"
  fi
fi
if [[ ,$PARTS, == *,ab,* ]]; then
  [ -f "$IDEAL" ] || { echo "PARTS=ab needs $IDEAL (run PARTS=bounds first)"; exit 2; }
  BUDGET_BOUND=()
  if [ -n "${SAME_BUDGET:-}" ]; then
    [ -f "$BUDGET" ] || { echo "SAME_BUDGET=1 PARTS=ab needs $BUDGET (run PARTS=bounds first)"; exit 2; }
    BUDGET_BOUND=(--budget-bound-from "$BUDGET")
  fi
  LAYOUTS=${LAYOUTS:-static4,dynamic}; TARGET_LAYOUT=${TARGET_LAYOUT:-dynamic}; LIMIT=${LIMIT:-240}
  go "$LIMIT" dyncp_megatron_workload_$TAG "${RUN[@]}" --nproc-per-node 4 dyncp_longtail.py "${D[@]}" \
    --tokens-per-rank 2048 --max-seqlen 2048 --layouts "$LAYOUTS" --repeats 3 --targets \
    --target-layout "$TARGET_LAYOUT" --ideal-from "$IDEAL" "${BUDGET_BOUND[@]}" \
    --out results/dyncp_megatron_workload_$TAG.json
fi
ls -l "$OUT/results"
