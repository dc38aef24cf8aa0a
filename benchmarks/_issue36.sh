# Sourced first by the issue-36 device scripts (after `set -uo pipefail`): . "$(dirname "$0")/_issue36.sh" NAME "$@"
# The script's arguments are TAG (e.g. h200x4) and OUT (the device's $OUT). This moves into benchmarks/, sources
# _go.sh (go LIMIT NAME CMD...) with the JSON-and-errors output filter, packs $OUT/results into $OUT/NAME.tgz on
# exit (the device returns few files; one archive keeps them all), and names what the scripts share: RUN
# (torchrun, standalone; add --nproc-per-node) and the verl overrides OVERLAP (DDP's overlapped grad reduce and
# param gather), FSDP (Megatron-FSDP optim_grads_params), BF16 (bf16 gradient reduction), DDP (OVERLAP + BF16).
# GPUS (environment, default 4): the data-parallel size of scripts that take it; their record names carry it, and
# only a 4-GPU run writes the *_4gpu targets (TARGETS holds its --target arguments or nothing). STEP16K: the
# part-3 step of issue36_gpu_f.sh on (1.5B shape, 16 sequences of 4096 tokens per replica, Triton LM head,
# 16K-token micro-batches, full recompute); a script adds its step counts.
NAME=${1:?archive name}; TAG=${2:?tag, e.g. h200x4}; OUT=${3:?output dir}
cd "$(dirname "${BASH_SOURCE[0]}")"
mkdir -p "$OUT/results"
. ./_go.sh
go_filter() { grep -v -i "warn" | grep -E '^\{|rror' | cut -c1-300 | tail -3; }  # JSON records and errors only
trap 'tar czf "$OUT/$NAME.tgz" -C "$OUT" results; rm -rf "$OUT/results"' EXIT
RUN=(python3 -m torch.distributed.run --standalone)
GPUS=${GPUS:-4}
AM=actor_rollout_ref.actor.megatron
OVERLAP=("+$AM.override_ddp_config.overlap_grad_reduce=true" "+$AM.override_ddp_config.overlap_param_gather=true")
STEP16K=(--shape qwen2.5-1.5b --seq 4096 --seqs-per-replica 16 --fused-kernels --max-token-len 16384 --recompute)
FSDP=("$AM.use_megatron_fsdp=true" "+$AM.override_ddp_config.data_parallel_sharding_strategy=optim_grads_params")
BF16=("+$AM.override_ddp_config.grad_reduce_in_fp32=false")
# DDP + distributed optimizer as every issue-36 record ran it: overlapped, bf16 gradient reduction (the engine's
# default until it took verl's fp32 default, verl_engine.build.VERL_DDP_DEFAULTS), the precision of the FSDP runs
DDP=("${OVERLAP[@]}" "${BF16[@]}")
