#!/usr/bin/env bash
# Issue 36, part 3: what holds Megatron-FSDP's extra transient memory (about 2.6 GiB above DDP's at the 1.5B shape,
# the same at DP 2 and DP 4; neither the communication unit nor the post-step gather, issue36_gpu_h.sh and _k.sh).
# The allocator's history over one profiled step, replayed to its peak (BENCH_PROFILE_KIND=memory,
# benchmarks/_memory_peak.py): the sites holding the step's memory at that moment, per rank. DDP + distributed
# optimizer and Megatron-FSDP bf16 reduce, the step of issue36_gpu_h.sh. GPUS (default 4) GPUs, one device command
# (about 3 minutes; everything packed into OUT/issue36_l.tgz, the summaries under results/prof_l).
# Usage (wheelhouse installed, PYTHONPATH set, BENCH_COMMIT the commit): bash benchmarks/issue36_gpu_l.sh TAG OUT
set -uo pipefail
. "$(dirname "$0")/_issue36.sh" issue36_l "$@"  # TAG OUT; RUN, go, OVERLAP, FSDP, BF16, GPUS
trap 'cp -r /tmp/prof_l "$OUT/results/" 2>/dev/null; tar czf "$OUT/issue36_l.tgz" -C "$OUT" results; rm -rf "$OUT/results"' EXIT
M=("${STEP16K[@]}" --steps 1 --warmup 1)
export BENCH_PROFILE_KIND=memory BENCH_PROFILE_DIR=/tmp/prof_l
go 120 "memory_1.5b_dp${GPUS}_ddp_mt16k_$TAG" "${RUN[@]}" --nproc-per-node "$GPUS" scaling_gpu.py "${M[@]}" \
  --out "results/memory_1.5b_dp${GPUS}_ddp_mt16k_$TAG.json" --override "${DDP[@]}"
go 130 "memory_1.5b_dp${GPUS}_mfsdp_bf16_mt16k_$TAG" "${RUN[@]}" --nproc-per-node "$GPUS" scaling_gpu.py "${M[@]}" \
  --out "results/memory_1.5b_dp${GPUS}_mfsdp_bf16_mt16k_$TAG.json" --override "${FSDP[@]}" "${BF16[@]}"
python3 -c "import json,glob
for f in sorted(glob.glob('/tmp/prof_l/*rank0.txt')):
    d = json.load(open(f)); print(f, round(d['peak_gib'], 2), 'GiB transient over', round(d['allocated_before_gib'], 2))
    [print('  ', round(s['gib'], 3), s['blocks'], s['site'][:230]) for s in d['sites'][:8]]"
ls -l "$OUT/results"
