#!/usr/bin/env python3
"""Long-tail packed training through verl-engine: no CP, static CP 2 / 4, dynamic CP (tokens/s, peak memory).

    torchrun --nproc-per-node 4 benchmarks/dyncp_longtail.py --out benchmarks/results/dyncp_longtail_h200x4.json

Data: sequence lengths drawn from a lognormal (median ``--median``, sigma ``--sigma``, seed ``--seed``),
clipped to [``--min-len``, ``--max-len``] (default 256, 32768); each step's global batch holds sequences until it has ``--tokens-per-step``
tokens; the same batches are used for every layout. Every layout gets the same micro-batch budget per rank
(``--tokens-per-rank``; a micro-batch holds at most that x the pool size, formed longest-first by
verl_engine.packed.split_packed_micro_batches), so the layouts differ only in how each micro-batch is
spread over the GPUs:

* no CP: k = 1 (each sequence whole on one GPU; the longest one then holds up to 32K tokens on one GPU),
* static CP 2 / 4: every sequence split over groups of 2 / 4,
* dynamic CP: k per micro-batch from max_seqlen_per_dp_cp_rank (``--max-seqlen``, default the per-rank
  budget; ``dynamic@8192`` runs it with 8192).

A ``+te`` suffix (``static4+te``, ``dynamic+te``) runs the layout with Transformer Engine's attention
(megatron.packed_attention_backend=te: TE's fused attention and TE's own ring CP) instead of verl-dyncp's.

Model: the engine's Qwen2 preset (``--preset``), bf16, megatron-core DDP + distributed optimizer, verl-dyncp
attention with torch's varlen flash kernel (Transformer Engine's with ``+te``). Tokens/s counts real (unpadded) tokens
of the global batch per second of optimizer step, averaged over the steps after ``--warmup``; peak memory is
torch.cuda.max_memory_allocated, the maximum over ranks. One process group; the layouts run one after the
other, each with a freshly built engine (same seed: same initial weights), so their losses are comparable.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from _record import write_record

LAYOUTS = ("none", "static2", "static4", "dynamic", "dynamic@8192")


def lengths_for_steps(
    *,
    steps: int,
    tokens_per_step: int,
    median: float,
    sigma: float,
    seed: int,
    min_len: int = 256,
    max_len: int = 32768,
) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        lens: list[int] = []
        while sum(lens) < tokens_per_step:
            n = int(np.clip(rng.lognormal(np.log(median), sigma), min_len, max_len))
            lens.append(min(n, tokens_per_step - sum(lens)) if sum(lens) + n > tokens_per_step else n)
        out.append([n for n in lens if n >= 1])
    return out


def layout_overrides(name: str, args: argparse.Namespace) -> list[str]:
    """The megatron section's CP keys of a layout name: none, static<k>, dynamic[@max_seqlen_per_dp_cp_rank]."""
    name = name.partition("+")[0]  # "+te": the attention backend, not the layout
    if name == "none":
        return ["megatron.context_parallel_size=1"]
    if name.startswith("static"):
        return [f"megatron.context_parallel_size={int(name[len('static') :])}"]
    _, _, seqlen = name.partition("@")  # "dynamic@8192": another max_seqlen_per_dp_cp_rank
    return [
        "megatron.dynamic_context_parallel=true",
        f"megatron.max_seqlen_per_dp_cp_rank={int(seqlen) if seqlen else args.max_seqlen}",
    ]


def step_data(lens: list[int], *, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Random sequences of ``lens`` in verl's layout (first token the prompt, the rest the trained response)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lens)
    ids = torch.zeros((len(lens), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        ids[i, :n] = torch.randint(0, vocab, (n,), generator=g)
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "response_mask": mask[:, 1:].clone()}


def run_layout(name: str, args: argparse.Namespace, steps_lens: list[list[int]], dims: Any) -> dict[str, Any]:
    from verl_config import SFTConfig, load_config
    from verl_engine.build import build_rl_engine
    from verl_engine.losses import sft_loss
    from verl_engine.micro_batching import MicroBatching
    from verl_mcore_utils.presets import qwen2_preset

    cfg = load_config(
        SFTConfig,
        overrides=[
            f"model.preset={args.preset}",
            "megatron.dtype=bfloat16",
            "megatron.use_distributed_optimizer=true",
            "optim.lr=1e-4",
            "optim.lr_warmup_steps=0",
            f"megatron.packed_attention_backend={name.partition('+')[2] or 'auto'}",
            *layout_overrides(name, args),
        ],
    )
    hf = qwen2_preset(args.preset, vocab_size=args.vocab, max_position_embeddings=32768)
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    engine = build_rl_engine(
        engine=cfg.megatron,
        model_path=None,
        optim=cfg.optim,
        micro_batching=MicroBatching(use_dynamic_bsz=True, max_token_len_per_gpu=args.tokens_per_rank),
        device=device,
        hf_config=hf,
        total_training_steps=len(steps_lens),
    )
    step_times, losses, plans = [], [], []
    real_tokens = []
    for step, lens in enumerate(steps_lens):
        batch = step_data(lens, vocab=args.vocab, seed=1000 + step)
        if step == 0:
            plans = [list(sizes) for sizes in engine.plan_cp_sizes(batch)]
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        with engine.train_mode():
            out = engine.train_batch(batch, sft_loss)
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        losses.append(float(out["loss"]))
        if step >= args.warmup:
            step_times.append(elapsed)
            real_tokens.append(sum(lens))
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    t = torch.tensor([sum(step_times)], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's clock: a step ends when all ranks end
    result = {
        "layout": engine.cp_layout.describe(),
        "attention": cfg.megatron.packed_attention_backend,
        "tokens_per_s": sum(real_tokens) / float(t.item()),
        "step_time_s_mean": float(t.item()) / len(step_times),
        "step_times_s_rank0": step_times,
        "peak_memory_gib": float(peak.item()),
        "losses": losses,
        "micro_batch_cp_sizes_step0": plans,
    }
    engine.close()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="base")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tokens-per-step", type=int, default=262144)
    parser.add_argument("--tokens-per-rank", type=int, default=16384)
    parser.add_argument(
        "--max-seqlen",
        type=int,
        default=16384,
        help="max_seqlen_per_dp_cp_rank of dynamic CP (default: the budget)",
    )
    parser.add_argument("--median", type=float, default=2048.0)
    parser.add_argument("--sigma", type=float, default=1.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-len", type=int, default=256, help="lengths are clipped to [min, max]")
    parser.add_argument("--max-len", type=int, default=32768)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run (debug backend)"
    )
    args = parser.parse_args()

    from verl_mcore_utils.parallel import destroy_parallel, init_parallel

    dims = init_parallel(device=args.device)
    steps_lens = lengths_for_steps(
        steps=args.steps,
        tokens_per_step=args.tokens_per_step,
        median=args.median,
        sigma=args.sigma,
        seed=args.seed,
        min_len=args.min_len,
        max_len=args.max_len,
    )
    all_lens = [n for lens in steps_lens for n in lens]
    results = {}
    for name in args.layouts.split(","):
        try:
            results[name] = run_layout(name, args, steps_lens, dims)
        except torch.OutOfMemoryError as err:  # "no CP where it fits": record, do not hide
            results[name] = {"layout": name, "error": f"out of memory: {str(err).splitlines()[0]}"}
            gc.collect()
            torch.cuda.empty_cache()
        if dist.get_rank() == 0:
            print(name, json.dumps({k: v for k, v in results[name].items() if k != "losses"}), flush=True)
    if dist.get_rank() == 0:
        base = results.get("static4", {}).get("tokens_per_s")
        record = write_record(
            args.out,
            benchmark="dyncp_longtail",
            device=None if args.device == "cuda" else "cpu (smoke run)",
            extra_versions=("transformer_engine",),  # the ``+te`` layouts need it
            config={
                **{k: v for k, v in vars(args).items() if k != "out"},
                "lengths": {
                    "distribution": f"lognormal(median={args.median}, sigma={args.sigma}) clipped to [{args.min_len}, {args.max_len}]",
                    "count": len(all_lens),
                    "min": min(all_lens),
                    "p50": int(np.median(all_lens)),
                    "p90": int(np.percentile(all_lens, 90)),
                    "max": max(all_lens),
                    "per_step_max": [max(lens) for lens in steps_lens],
                },
            },
            numbers={
                "gpus": dist.get_world_size(),
                # Transport settings change what CP communication costs (NCCL_P2P_DISABLE: no NVLink).
                "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
                "results": results,
                "speedup_vs_static4": {
                    k: v["tokens_per_s"] / base for k, v in results.items() if base and "tokens_per_s" in v
                },
            },
        )
        print(json.dumps(record["speedup_vs_static4"]), flush=True)
    destroy_parallel()
    os._exit(0)


if __name__ == "__main__":
    main()
