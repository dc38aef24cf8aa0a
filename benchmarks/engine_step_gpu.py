"""The RL engine's steps on one GPU beside the GPU's own matmul ceiling: SFT, PPO actor, log-prob pass.

    cd benchmarks && python3 engine_step_gpu.py --shape qwen2.5-1.5b --seq 4096 --out results/engine_step_1.5b_4k_h100.json

A Qwen2.5-shaped megatron-core model (random weights, bf16, no Transformer Engine) built by
``rl_engine_from_config`` (verl-config ``ppo_trainer``, model_engine=megatron, distributed optimizer,
dynamic batch size with ``ppo_max_token_len_per_gpu = --seq``: micro-batches of one ``--seq``-token
packed row; ``--max-token-len`` packs several sequences per micro-batch). For each LM-head variant
(megatron-core's output layer + chunked log-probs, and the fused head of ``model.use_fused_kernels``) and
each step size in ``--steps-of`` (``--parts`` picks which of the three below run):

* SFT step: ``optimizer_zero_grad`` + ``forward_backward_batch(sft_loss)`` + ``optimizer_step``;
* PPO actor step: the same with verl's PPO loss and the entropy term (``calculate_entropy``);
* log-prob pass: ``infer_batch`` with entropy (verl's old-log-prob pass), forward only;

each timed (median of ``--repeat`` after one warm-up), its peak memory (``max_memory_allocated`` reset
before it), the optimizer step's own time, and model FLOP/s with Megatron-LM's counting (full attention
``s^2`` term, no causal halving, LM head included, backward = 2 x forward), as MFU of the 989 TFLOP/s
dense bf16 peak of H100 / H200 SXM and as a share of the matmul ceiling measured in the same run
(bf16 8192^3 matmuls). Lengths: ``--lengths fixed`` gives every sequence ``--seq`` tokens;
``--lengths varied`` draws them from 256 to ``--seq`` (long tail) and packs them into ``--seq``-token rows.
Finally the engine is closed and a second one built and closed: device memory before, between and
after (``Engine.close`` returns everything).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch
from _common import (
    PEAK_BF16_TFLOPS,
    SHAPES,
    build,
    flops_per_sequence,
    lengths_for,
    make_batch,
    synced,
    train_step,
)
from _record import write_record


def matmul_ceiling_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / 10)
    return 2 * 8192**3 / min(times) / 1e12


def measure(run, *, repeat: int) -> dict:
    """Median seconds of ``run()`` (after one warm-up) and the peak memory of the timed calls."""
    run()
    torch.cuda.reset_peak_memory_stats()
    results = [synced(run) for _ in range(repeat)]
    return {
        "seconds": statistics.median(t for _, t in results),
        "seconds_all": [t for _, t in results],
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "last": results[-1][0],
    }


def run_variant(args: argparse.Namespace, *, fused: bool, ceiling: float) -> dict:
    from verl_engine.losses import ppo_loss, sft_loss

    _, _, _, _, _, vocab, _ = SHAPES[args.shape]
    out: dict = {"fused_lm_head": fused, "steps": {}}
    biggest = max(args.steps_of)
    engine, cfg = build(
        args.shape,
        seq=args.seq,
        fused=fused,
        sequences=biggest,
        recompute=args.recompute,
        extra=tuple(args.override),
        max_token_len=args.max_token_len,
    )
    ppo = partial(ppo_loss, config=cfg.actor_rollout_ref.actor)
    for count in args.steps_of:
        lengths = lengths_for(args.lengths, count=count, seq=args.seq, seed=count)
        batch = make_batch(lengths, vocab=vocab, seed=count)
        tokens = sum(lengths)
        flops = sum(flops_per_sequence(args.shape, n) for n in lengths)
        record: dict = {"sequences": count, "tokens": tokens, "model_tflop_per_step": flops / 1e12}
        for name, loss_fn, data in (
            ("sft", sft_loss, batch),
            ("ppo", ppo, {**batch, "calculate_entropy": True}),
        ):
            if name not in args.parts or (name == "ppo" and count != min(args.steps_of)):
                continue  # the PPO step at the smallest step size only (its cost per token is the SFT one's)
            optimizer_s: list[float] = []
            with engine.train_mode():
                m = measure(partial(train_step, engine, loss_fn, data, optimizer_s), repeat=args.repeat)
            seconds = m["seconds"]
            opt = statistics.median(optimizer_s[1:])
            record[name] = {
                "seconds": seconds,
                "seconds_all": m["seconds_all"],
                "tokens_per_s": tokens / seconds,
                "model_tflops": flops / seconds / 1e12,
                "mfu": flops / seconds / 1e12 / PEAK_BF16_TFLOPS,
                "share_of_matmul_ceiling": flops / seconds / 1e12 / ceiling,
                "optimizer_seconds": opt,
                "optimizer_share": opt / seconds,
                "peak_memory_gib": m["peak_memory_gib"],
                "loss": float(m["last"]["loss"]),
            }
        if "log_prob" in args.parts:
            with engine.eval_mode():
                m = measure(
                    partial(engine.infer_batch, {**batch, "calculate_entropy": True}), repeat=args.repeat
                )
            forward_flops = flops / 3
            record["log_prob"] = {
                "seconds": m["seconds"],
                "tokens_per_s": tokens / m["seconds"],
                "model_tflops": forward_flops / m["seconds"] / 1e12,
                "mfu": forward_flops / m["seconds"] / 1e12 / PEAK_BF16_TFLOPS,
                "peak_memory_gib": m["peak_memory_gib"],
            }
        out["steps"][str(count)] = record
        print(json.dumps({"fused": fused, **record}, default=float), flush=True)
    # the engine's own memory: parameters, gradients and optimizer state, then close() returns it all
    out["memory_gib_with_engine"] = torch.cuda.memory_allocated() / 2**30
    engine.close()
    out["memory_gib_after_close"] = torch.cuda.memory_allocated() / 2**30
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--lengths", choices=("fixed", "varied"), default="fixed")
    parser.add_argument(
        "--steps-of", type=int, nargs="+", default=[8, 64], help="sequences per optimizer step"
    )
    parser.add_argument("--variants", nargs="+", choices=("plain", "fused"), default=["plain", "fused"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--recompute", action="store_true", help="full activation recompute (MFU excludes it)"
    )
    parser.add_argument("--override", nargs="*", default=[], help="extra verl config overrides (key=value)")
    parser.add_argument(
        "--max-token-len",
        type=int,
        default=None,
        help="tokens per packed micro-batch row (ppo_max_token_len_per_gpu; default --seq: one sequence each)",
    )
    parser.add_argument(
        "--torch-ops",
        nargs="*",
        choices=("swiglu", "vocab"),
        default=[],
        help="run these parts with torch ops instead of our Triton kernels (A/B)",
    )
    parser.add_argument(
        "--parts", nargs="+", choices=("sft", "ppo", "log_prob"), default=["sft", "ppo", "log_prob"]
    )
    parser.add_argument(
        "--vocab", type=int, default=None, help="replace the shape's vocabulary size (memory vs vocabulary)"
    )
    args = parser.parse_args()
    if args.vocab is not None:
        shape = list(SHAPES[args.shape])
        shape[5] = args.vocab
        SHAPES[args.shape] = tuple(shape)

    from verl_mcore_utils.parallel import init_parallel

    init_parallel(device="cuda")
    with contextlib.ExitStack() as stack:
        if "swiglu" in args.torch_ops:
            from verl_mcore_utils.swiglu import torch_form_only

            stack.enter_context(torch_form_only())
        if "vocab" in args.torch_ops:
            from verl_engine.vocab_kernels import torch_ops_only

            stack.enter_context(torch_ops_only())
        run_all(args)


def run_all(args: argparse.Namespace) -> None:
    ceiling = matmul_ceiling_tflops()
    start = torch.cuda.memory_allocated() / 2**30
    variants = [run_variant(args, fused=v == "fused", ceiling=ceiling) for v in args.variants]
    record = write_record(
        args.out,
        benchmark="engine_step_gpu",
        config={
            "shape": args.shape,
            "vocab": SHAPES[args.shape][5],
            "seq": args.seq,
            "lengths": args.lengths,
            "micro_batch": f"one packed row of {args.max_token_len or args.seq} tokens (dynamic bsz)",
            "dtype": "bfloat16",
            "transformer_engine": False,
            "activation_recompute": "full, uniform, 1 layer" if args.recompute else "none",
            "optimizer": "megatron distributed optimizer, torch fused Adam (verl_mcore_utils.use_fused_torch_adam)",
            "flop_counting": "Megatron-LM: full attention s^2, LM head included, training = 3 x forward",
            "peak_bf16_tflops": PEAK_BF16_TFLOPS,
            "overrides": args.override,
            "torch_ops_instead_of_triton": args.torch_ops,
        },
        numbers={
            "matmul_ceiling_tflops": ceiling,
            "memory_gib_at_start": start,
            "variants": variants,
            "memory_gib_at_end": torch.cuda.memory_allocated() / 2**30,
        },
    )
    print(json.dumps({k: v for k, v in record.items() if k != "variants"}, indent=2, default=float))


if __name__ == "__main__":
    main()
