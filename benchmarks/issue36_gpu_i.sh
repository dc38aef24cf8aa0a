#!/usr/bin/env bash
# Issue 36, part 3: 50-step loss curves of Megatron-FSDP and DDP + distributed optimizer on GPUS (default 4) GPUs, a new batch
# every step (scaling_gpu.py --vary-batch), 16K-token micro-batches with recompute. The bf16 noise band is
# measured: DDP again with fp32 instead of bf16 gradient reduction. loss_curves.py says whether Megatron-FSDP
# (bf16 reduce, verl-mfsdp's communication unit) stays within 2 x that band. One device command (about 7
# minutes; everything packed into OUT/issue36_i.tgz).
# Usage (wheelhouse installed, PYTHONPATH set, BENCH_COMMIT the commit): bash benchmarks/issue36_gpu_i.sh TAG OUT
set -uo pipefail
. "$(dirname "$0")/_issue36.sh" issue36_i "$@"  # TAG OUT; RUN, go, OVERLAP, FSDP, BF16, DDP
M=("${STEP16K[@]}" --steps 49 --warmup 1 --vary-batch)
go 200 "curve50_ddp_$TAG" "${RUN[@]}" --nproc-per-node "$GPUS" scaling_gpu.py "${M[@]}" --out "results/curve50_ddp_$TAG.json" \
  --override "${DDP[@]}"
go 200 "curve50_ddp_fp32reduce_$TAG" "${RUN[@]}" --nproc-per-node "$GPUS" scaling_gpu.py "${M[@]}" --out "results/curve50_ddp_fp32reduce_$TAG.json" \
  --override "${OVERLAP[@]}" "+$AM.override_ddp_config.grad_reduce_in_fp32=true"
go 200 "curve50_mfsdp_bf16_$TAG" "${RUN[@]}" --nproc-per-node "$GPUS" scaling_gpu.py "${M[@]}" --out "results/curve50_mfsdp_bf16_$TAG.json" \
  --override "${FSDP[@]}" "${BF16[@]}"
python3 loss_curves.py --reference "results/curve50_ddp_$TAG.json" --noise "results/curve50_ddp_fp32reduce_$TAG.json" \
  --run "results/curve50_mfsdp_bf16_$TAG.json" --out "results/curve50_mfsdp_vs_ddp_$TAG.json"
cp "results/curve50_mfsdp_vs_ddp_$TAG.json" "$OUT/results/" 2>/dev/null
ls -l "$OUT/results"
