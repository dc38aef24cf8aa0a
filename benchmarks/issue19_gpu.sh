#!/usr/bin/env bash
# Issue 19's single-GPU figures in one lease (so before/after and ceiling share a machine).
# Usage (device machine, wheelhouse/ carried): bash benchmarks/issue19_gpu.sh OUT_DIR PART... (sim, steps, memory_and_shapes)
set -uo pipefail
out=$(realpath "$1")
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site wheelhouse/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
step() { python3 engine_step_gpu.py --variants fused "$@"; }
mc=actor_rollout_ref.actor.megatron.override_transformer_config
for part in "${@:2}"; do
case "$part" in
sim)
  timeout 200 python3 dyncp_plan_sim_gpu.py --out "$out/dyncp_plan_sim.json" | grep -v '^ '
  ;;
steps)
  # headline: 1.5B, 4096-token sequences, 8192-token micro-batches, 8 and 64 sequences per step
  step --shape qwen2.5-1.5b --seq 4096 --max-token-len 8192 --out "$out/engine_step_1.5b_4k_mt8k.json"
  # 4096-token micro-batches (micro-batch 1): Triton kernels vs torch ops (the unexplained slowdown), peak memory
  step --shape qwen2.5-1.5b --seq 4096 --steps-of 8 --parts sft log_prob --out "$out/ab4k_triton.json"
  step --shape qwen2.5-1.5b --seq 4096 --steps-of 8 --parts sft log_prob --torch-ops swiglu vocab --out "$out/ab4k_torch.json"
  step --shape qwen2.5-1.5b --seq 4096 --steps-of 8 --parts sft \
    --override "$mc.recompute_granularity=selective" "$mc.recompute_modules=[mlp]" --out "$out/mb1_selective_mlp.json"
  ;;
memory_and_shapes)
  for v in 32768 151936 262144; do  # log-prob pass peak vs vocabulary size
    step --shape qwen2.5-1.5b --seq 4096 --steps-of 8 --parts log_prob --vocab $v --out "$out/logprob_vocab_$v.json"
  done
  step --shape qwen2.5-0.5b --seq 4096 --max-token-len 8192 --out "$out/engine_step_0.5b_4k_mt8k.json"
  step --shape qwen2.5-1.5b --seq 16384 --lengths varied --steps-of 16 --recompute --out "$out/engine_step_1.5b_16k_varied.json"
  ;;
esac
done
