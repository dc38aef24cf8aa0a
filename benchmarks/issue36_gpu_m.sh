#!/usr/bin/env bash
# Issue 36 part 4 on one GPU (about 5 minutes; OUT/issue36_m.tgz): CUDA graphs of the decoder under the engine.
# First the GPU tests of the graph (the engine's DDP actor graphed vs eager across an offload; the graphed decoder's
# replays), then Megatron-LM's dynamic-CP workload on one GPU with every micro-batch at CP 1 (2048 tokens):
# `none` (eager) vs `none+graph` (verl_engine.use_decoder_graphs), 2 repeats in turn. The 4-GPU A/B is
# LAYOUTS=static4,dynamic,dynamic+graph TARGET_LAYOUT=dynamic+graph bash benchmarks/issue36_dyncp_gpu.sh TAG OUT.
# Usage (wheelhouse installed, PYTHONPATH set, BENCH_COMMIT the commit): bash benchmarks/issue36_gpu_m.sh TAG OUT
set -uo pipefail
. "$(dirname "$0")/_issue36.sh" issue36_m "$@"  # TAG OUT; RUN, go
(cd .. && timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs -s tests/test_gpu_decoder_graph.py \
  packages/verl-dyncp/tests/test_gpu_graph_layout.py 2>&1 | grep -v -i warn | tail -40 | tee "$OUT/results/tests_$TAG.log")
D=(--preset 1b --layers 12 --vocab 32000 --mean 1024 --sigma 1.0 --min-len 128 --max-len 8192
   --tokens-per-step 65536 --steps 5 --warmup 1)
go 200 "dyncp_graph_1gpu_$TAG" "${RUN[@]}" --nproc-per-node 1 dyncp_longtail.py "${D[@]}" --tokens-per-rank 2048 \
  --layouts none,none+graph --repeats 2 --out "results/dyncp_graph_1gpu_$TAG.json"
