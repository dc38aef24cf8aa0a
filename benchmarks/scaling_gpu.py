#!/usr/bin/env python3
"""Training throughput of one layout on N GPUs: data parallel scaling, pipeline stages vs data parallel, MFU.

    torchrun --nproc-per-node 1 benchmarks/scaling_gpu.py --out benchmarks/results/scaling_1.5b_dp1_h200.json
    torchrun --nproc-per-node 4 benchmarks/scaling_gpu.py --baseline benchmarks/results/scaling_1.5b_dp1_h200.json \
        --out benchmarks/results/scaling_1.5b_dp4_h200.json --target dp4_scaling_efficiency:scaling_efficiency
    torchrun --nproc-per-node 2 benchmarks/scaling_gpu.py --pp 2 --out benchmarks/results/scaling_1.5b_pp2_h200.json

A Qwen2.5-shaped megatron-core model (random weights, bf16, no Transformer Engine) built by
``rl_engine_from_config`` from verl-config overrides (``ppo_trainer``, model_engine=megatron, distributed
optimizer, dynamic batch size: micro-batches of one ``--seq``-token packed row), the same on every rank. Each
optimizer step is verl's PPO actor step (``forward_backward_batch`` with the engine's PPO loss and the entropy
term, then ``optimizer_step``) over ``--seqs-per-replica`` sequences of ``--seq`` tokens per data-parallel
replica: the work per replica is fixed, so with pure data parallelism the work per GPU is too (weak scaling,
how Megatron-LM reports scaling). Every rank is handed the whole global batch, as verl's dispatcher does for
this engine; the engine takes its replica's share.

Reported (rank 0; times are the slowest rank's, a step ends when every rank ends): seconds per step (median
of ``--steps`` after ``--warmup``), tokens/s, tokens/s per GPU, model TFLOP/s per GPU and MFU of the
989 TFLOP/s dense bf16 peak of H100 / H200 SXM (Megatron-LM's counting: full attention ``s^2`` term, LM head
included, backward = 2 x forward), peak memory (``max_memory_allocated``, maximum over ranks). With
``--baseline`` (the one-GPU record of the same shape and sequences per replica) the scaling efficiency:
tokens/s per GPU here over tokens/s per GPU there. With ``--versus`` (another layout's record on the same GPUs,
shape and batch, e.g. DDP + distributed optimizer against Megatron-FSDP) the ratios ``tokens_ratio`` and
``memory_ratio`` (this run over that one). ``--target KEY:METRIC`` stores a number (``scaling_efficiency``,
``mfu``, ``tokens_ratio``, ``memory_ratio``) in ``benchmarks/results/targets.json`` under KEY.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from _common import (
    PEAK_BF16_TFLOPS,
    SHAPES,
    StepProfile,
    build,
    flops_per_sequence,
    make_batch,
    slowest_rank_seconds,
)
from _record import update_target, write_record


def numbers_micro_batch(args: argparse.Namespace) -> str:
    """The micro-batch setting as the records state it (compared by --baseline and --versus)."""
    return f"one packed row of {args.max_token_len or args.seq} tokens (dynamic bsz)"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--seqs-per-replica", type=int, default=16)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--max-token-len",
        type=int,
        default=None,
        help="ppo_max_token_len_per_gpu: tokens per micro-batch (default --seq: one sequence per micro-batch)",
    )
    parser.add_argument(
        "--recompute", action="store_true", help="full activation recompute, one layer per checkpoint"
    )
    parser.add_argument(
        "--fused-kernels",
        action="store_true",
        help="model.use_fused_kernels=true: the Triton LM head (log-probs and entropy without [T, V] logits)",
    )
    parser.add_argument(
        "--vary-batch",
        action="store_true",
        help="a new batch every step (seed = step): a loss curve, for comparing layouts over many steps",
    )
    parser.add_argument("--override", nargs="*", default=[], help="more verl config overrides (key=value)")
    parser.add_argument("--baseline", type=Path, default=None, help="the one-GPU record to compare with")
    parser.add_argument("--versus", type=Path, default=None, help="another layout's record of the same work")
    parser.add_argument(
        "--target",
        action="append",
        default=[],
        help="KEY:METRIC, a targets.json key and the number it takes (repeatable)",
    )
    args = parser.parse_args()

    from verl_engine.losses import ppo_loss
    from verl_mcore_utils.parallel import destroy_parallel, init_parallel

    init_parallel(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp,
        device="cuda",
    )
    world = dist.get_world_size()
    replicas = world // (args.tp * args.pp)
    sequences = replicas * args.seqs_per_replica
    am = "actor_rollout_ref.actor.megatron"
    layout = [
        f"trainer.n_gpus_per_node={world}",
        f"{am}.tensor_model_parallel_size={args.tp}",
        f"{am}.pipeline_model_parallel_size={args.pp}",
        *([f"{am}.virtual_pipeline_model_parallel_size={args.vpp}"] if args.vpp else []),
        *args.override,
    ]
    torch.cuda.reset_peak_memory_stats()
    engine, cfg = build(
        args.shape,
        seq=args.seq,
        fused=args.fused_kernels,
        sequences=sequences,
        recompute=args.recompute,
        max_token_len=args.max_token_len,
        extra=tuple(layout),
    )
    loss_fn = partial(ppo_loss, config=cfg.actor_rollout_ref.actor)
    vocab = SHAPES[args.shape][5]
    lengths = [args.seq] * sequences
    batch = {**make_batch(lengths, vocab=vocab, seed=0), "calculate_entropy": True}
    tokens = sum(lengths)
    flops = sum(flops_per_sequence(args.shape, n) for n in lengths)
    times, losses = [], []
    profile = StepProfile()
    with engine.train_mode():
        for step in range(args.warmup + args.steps):
            torch.cuda.synchronize()
            dist.barrier()
            if args.vary_batch:
                batch = {**make_batch(lengths, vocab=vocab, seed=step), "calculate_entropy": True}
            start = time.perf_counter()
            out = engine.train_batch(batch, loss_fn)
            torch.cuda.synchronize()
            elapsed = slowest_rank_seconds(seconds=time.perf_counter() - start)
            losses.append(float(out["loss"]))
            if step >= args.warmup:
                times.append(elapsed)
        if profile.folder:  # one more step, profiled, outside the timed ones
            with profile(args.out.stem):
                engine.train_batch(batch, loss_fn)
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    seconds = statistics.median(times)
    numbers = {
        "gpus": world,
        "layout": {"tp": args.tp, "pp": args.pp, "vpp": args.vpp, "dp": replicas},
        "engine": engine.describe(),
        "sequences_per_step": sequences,
        "tokens_per_step": tokens,
        "seconds_per_step": seconds,
        "seconds_all": times,
        "tokens_per_s": tokens / seconds,
        "tokens_per_s_per_gpu": tokens / seconds / world,
        "model_tflops_per_gpu": flops / seconds / 1e12 / world,
        "mfu": flops / seconds / 1e12 / world / PEAK_BF16_TFLOPS,
        "peak_memory_gib": float(peak.item()),
        "losses": losses,
    }
    engine.close()
    if dist.get_rank() == 0:
        if args.baseline is not None:
            base = json.loads(args.baseline.read_text())
            same = base["config"]["shape"] == args.shape and base["config"]["seq"] == args.seq
            same = same and all(
                base["config"].get(key, False) == getattr(args, key) for key in ("fused_kernels", "recompute")
            )
            same = same and base["config"].get("micro_batch") == numbers_micro_batch(args)
            if not same or base["config"]["seqs_per_replica"] != args.seqs_per_replica:
                raise SystemExit(f"--baseline {args.baseline} ran another shape / sequence / LM head setting")
            numbers["baseline"] = str(args.baseline)
            numbers["scaling_efficiency"] = numbers["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
        if args.versus is not None:
            other = json.loads(args.versus.read_text())
            if other["gpus"] != world or other["config"]["shape"] != args.shape:
                raise SystemExit(f"--versus {args.versus} ran on other GPUs or another shape")
            for key in ("fused_kernels", "recompute"):
                if other["config"].get(key, False) != getattr(args, key):
                    raise SystemExit(f"--versus {args.versus} ran with another --{key.replace('_', '-')}")
            if other["config"].get("micro_batch") != numbers_micro_batch(args):
                raise SystemExit(
                    f"--versus {args.versus} ran other micro-batches ({other['config'].get('micro_batch')})"
                )
            if other["tokens_per_step"] != tokens:
                raise SystemExit(
                    f"--versus {args.versus} ran another batch ({other['tokens_per_step']} tokens)"
                )
            numbers["versus"] = str(args.versus)
            numbers["tokens_ratio"] = numbers["tokens_per_s"] / other["tokens_per_s"]
            numbers["memory_ratio"] = numbers["peak_memory_gib"] / other["peak_memory_gib"]
        record = write_record(
            args.out,
            benchmark="scaling_gpu",
            config={
                "shape": args.shape,
                "seq": args.seq,
                "seqs_per_replica": args.seqs_per_replica,
                "step": "PPO actor step (forward_backward_batch with ppo_loss + entropy, optimizer_step)",
                "dtype": "bfloat16",
                "transformer_engine": False,
                "fused_kernels": args.fused_kernels,
                "recompute": args.recompute,
                "micro_batch": numbers_micro_batch(args),
                "batch": "a new batch every step (seed = step)"
                if args.vary_batch
                else "the same batch every step",
                "overrides": layout,
                "flop_counting": "Megatron-LM: full attention s^2, LM head included, training = 3 x forward",
                "peak_bf16_tflops": PEAK_BF16_TFLOPS,
                "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
                # torchrun sets OMP_NUM_THREADS=1 for several processes only: a one-process run has one thread
                # per core, which on a many-core host may slow the host-bound step (issue 36, part 5)
                "torch_threads": torch.get_num_threads(),
            },
            numbers=numbers,
        )
        print(json.dumps({k: v for k, v in record.items() if k != "versions"}, default=float), flush=True)
        goals = {
            "scaling_efficiency": ">= 0.95 (tokens/s per GPU against one GPU)",
            "mfu": ">= 0.47 (Megatron-LM's published 7.1B MFU, with Transformer Engine)",
            "tokens_ratio": ">= 0.9 (tokens/s against the --versus layout)",
            "memory_ratio": "<= 0.6 (peak memory against the --versus layout)",
        }
        for target in args.target:
            key, _, metric = target.partition(":")
            if metric not in goals or metric not in numbers:
                raise SystemExit(
                    f"--target {target!r}: METRIC must be one of {sorted(goals)} and measured here"
                )
            update_target(key, numbers[metric], goal=goals[metric], source=args.out, record=record)
    destroy_parallel()
    os._exit(0)


if __name__ == "__main__":
    main()
