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
(megatron.packed_attention_backend=te: TE's fused attention and TE's own ring CP) instead of verl-dyncp's;
``+graph`` (``+graph1``) replays CUDA graphs of the decoder for the micro-batches of every CP size (of CP 1 only).
Speedups are over the fastest static CP 4 layout measured (``baseline_layout`` in the record: ``static4``, or
``static4+graph`` when that runs faster): the baseline may use what the measured layouts use.

Model: the engine's Qwen2 preset (``--preset``), or Qwen3-30B-A3B's MoE shape with fewer layers (``--model
qwen3-30b-a3b --layers N --ep 4``: 128 experts, top 8, grouped experts, expert parallelism over the pool; its
records add MFU counting active parameters only), bf16, megatron-core DDP + distributed optimizer, verl-dyncp
attention with torch's varlen flash kernel (Transformer Engine's with ``+te``). Tokens/s counts real (unpadded) tokens
of the global batch per second of optimizer step, averaged over the steps after ``--warmup``; peak memory is
torch.cuda.max_memory_allocated, the maximum over ranks. One process group; the layouts run one after the
other, each with a freshly built engine (same seed: same initial weights), so their losses are comparable.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from _common import StepProfile, slowest_rank_seconds
from _record import update_target, write_record

LAYOUTS = ("none", "static2", "static4", "dynamic", "dynamic@8192")
PEAK_BF16_TFLOPS = 989.0  # H100 / H200 SXM dense bf16
# Qwen3-30B-A3B's Hugging Face config, all but the number of layers (``--layers``; 48 in the release).
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "vocab_size": 151936,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
    "max_position_embeddings": 32768, "attention_bias": False, "attention_dropout": 0.0,
    "output_router_logits": False, "torch_dtype": "bfloat16",
}  # fmt: skip


def moe_flops_per_sequence(hf: dict[str, Any], length: int) -> float:
    """Model FLOPs of one training pass over one sequence of a Qwen3-MoE config, active parameters only.

    Megatron-LM's counting (as ``_common.flops_per_sequence`` for dense models), per token and layer, forward:
    QKV ``2 h (q + 2 kv)``, attention output ``2 q h``, router ``2 h E``, the top-k experts' SwiGLU
    ``k * 6 h f``, attention scores and values ``2 * 2 s q`` (full s); plus the LM head ``2 h V``; training = 3x.
    """
    h, dim = hf["hidden_size"], hf["head_dim"]
    q, kv = hf["num_attention_heads"] * dim, hf["num_key_value_heads"] * dim
    experts, k, f = hf["num_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"]
    per_layer = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * h * experts + k * 6 * h * f + 4 * length * q
    return 3.0 * length * (hf["num_hidden_layers"] * per_layer + 2 * h * hf["vocab_size"])


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


GRAPH_OPTIONS = ("graph", "graph1")


def layout_options(name: str) -> tuple[str, str, str | None]:
    """``(layout, attention backend, decoder graphs)`` of a layout name such as ``dynamic+te`` or
    ``dynamic+graph``: after ``+`` the attention backend (default auto) and the decoder graphs
    (verl_engine.use_decoder_graphs): ``graph`` for the micro-batches of every CP size, ``graph1`` for the CP-1
    ones only (the others eager)."""
    base, *extras = name.split("+")
    backends = [e for e in extras if e not in GRAPH_OPTIONS]
    graphs = [e for e in extras if e in GRAPH_OPTIONS]
    if len(backends) > 1 or len(graphs) > 1:
        raise SystemExit(
            f"layout {name!r}: at most one attention backend and one of {GRAPH_OPTIONS} after '+', got {extras}"
        )
    return base, (backends[0] if backends else "auto"), (graphs[0] if graphs else None)


def layout_overrides(name: str, args: argparse.Namespace) -> list[str]:
    """The megatron section's CP keys of a layout name: none, static<k>, dynamic[@max_seqlen_per_dp_cp_rank]."""
    name = layout_options(name)[0]  # "+te", "+graph": how it runs, not the layout
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
            f"megatron.packed_attention_backend={layout_options(name)[1]}",
            f"megatron.expert_model_parallel_size={args.ep}",
            *layout_overrides(name, args),
        ],
    )
    layers = {"num_hidden_layers": args.layers} if args.layers else {}
    if args.model == "qwen3-30b-a3b":
        hf = {**QWEN3_30B_A3B, "num_hidden_layers": args.layers or 48}
    else:
        hf = qwen2_preset(args.preset, vocab_size=args.vocab, max_position_embeddings=32768, **layers)
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
    graphs = layout_options(name)[2]
    if graphs:
        from verl_engine.decoder_graphs import use_decoder_graphs

        if not cuda:
            raise SystemExit(f"layout {name!r}: decoder graphs need the engine on CUDA (--device cuda)")
        use_decoder_graphs(
            engine,
            tokens=args.graph_tokens or args.tokens_per_rank,
            sequences=args.graph_sequences,
            cp_graphs=graphs == "graph",
        )
    step_times, losses, plans = [], [], []
    profile = StepProfile()
    real_tokens = []
    timed_flops = 0.0
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
            if args.model == "qwen3-30b-a3b":
                timed_flops += sum(moe_flops_per_sequence(hf, n) for n in lens)
    if profile.folder:  # the last batch once more, profiled, outside the timed steps
        with engine.train_mode(), profile(f"{Path(args.out).stem}_{name}"):
            engine.train_batch(batch, sft_loss)
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    slowest = slowest_rank_seconds(seconds=sum(step_times), device=device)
    result = {
        "layout": engine.cp_layout.describe(),
        **(
            {"mfu_active_params": timed_flops / slowest / dist.get_world_size() / 1e12 / PEAK_BF16_TFLOPS}
            if args.model == "qwen3-30b-a3b"
            else {}
        ),
        "attention": cfg.megatron.packed_attention_backend,
        "tokens_per_s": sum(real_tokens) / slowest,
        "step_time_s_mean": slowest / len(step_times),
        "step_times_s_rank0": step_times,
        "peak_memory_gib": float(peak.item()),
        "losses": losses,
        "micro_batch_cp_sizes_step0": plans,
    }
    if layout_options(name)[2]:  # how many decoder calls replayed the graph, and why the others did not
        from verl_engine.decoder_graphs import decoder_graph_counts

        result["decoder_graph_counts"] = decoder_graph_counts(engine)
    engine.close()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def lengths_summary(args: argparse.Namespace, steps_lens: list[list[int]]) -> dict[str, Any]:
    all_lens = [n for lens in steps_lens for n in lens]
    return {
        "distribution": f"lognormal(median={args.median:.1f}, sigma={args.sigma}) clipped to [{args.min_len}, {args.max_len}]",
        "count": len(all_lens),
        "min": min(all_lens),
        "mean": float(np.mean(all_lens)),
        "p50": int(np.median(all_lens)),
        "p90": int(np.percentile(all_lens, 90)),
        "max": max(all_lens),
        "per_step_max": [max(lens) for lens in steps_lens],
        "per_step_count": [len(lens) for lens in steps_lens],
    }


def _one_gpu_run(path: Path, *, flag: str, lengths: dict[str, Any], tokens_per_rank: int) -> dict[str, Any]:
    """The record of a one-GPU run of these batches at ``tokens_per_rank``, or SystemExit naming ``flag``."""
    one = json.loads(path.read_text())
    if one["gpus"] != 1 or one["config"]["lengths"]["per_step_count"] != lengths["per_step_count"]:
        raise SystemExit(f"{flag} {path} is not a one-GPU run of these batches")
    if one["config"]["tokens_per_rank"] != tokens_per_rank:
        raise SystemExit(
            f"{flag} {path} cut other micro-batches (tokens_per_rank {one['config']['tokens_per_rank']},"
            f" {tokens_per_rank} needed)"
        )
    return one


def ideal_bound(
    args: argparse.Namespace, lengths: dict[str, Any], medians: dict[str, float], *, ranks: int
) -> dict[str, Any] | None:
    """The ideal-balance bound from a one-GPU run of the same batches (``--ideal-from``).

    One GPU runs each micro-batch whole (its budget is this run's pool budget, so the micro-batches are the
    same), at CP 1, with no communication; perfect balance over this run's ``ranks`` would take 1 / ranks of
    that time. Its tokens/s x ranks over static CP 4's is the most any plan of the same micro-batches can gain
    (an optimistic bound: kernels on a quarter of the tokens are no faster per token). The record's fastest
    layout counts (``none`` or ``none+graph``): a bound measured eagerly would flatter a graphed layout.
    """
    if args.ideal_from is None:
        return None
    one = _one_gpu_run(
        args.ideal_from, flag="--ideal-from", lengths=lengths, tokens_per_rank=args.tokens_per_rank * ranks
    )
    best, one_tps = _fastest(one)
    return _bound(
        args.ideal_from, one_tps, ranks=ranks, medians=medians, layout=best,
        tokens_key="ideal_tokens_per_s", speedup_key="ideal_bound_speedup_vs_static4",
    )  # fmt: skip


def same_budget_bound(
    args: argparse.Namespace, lengths: dict[str, Any], medians: dict[str, float], *, ranks: int
) -> dict[str, Any] | None:
    """A second bound from a one-GPU run at this run's per-rank budget (``--budget-bound-from``).

    The ideal bound's one GPU runs micro-batches ``ranks`` times larger than a rank may hold, so it also credits
    the fixed cost per micro-batch that larger micro-batches amortise. Here one GPU runs micro-batches of the
    per-rank budget (its fastest layout, eager or graphed), times the ranks: what perfect balance and no
    communication would give within the budget.
    """
    path = args.budget_bound_from
    if path is None:
        return None
    one = _one_gpu_run(
        path, flag="--budget-bound-from", lengths=lengths, tokens_per_rank=args.tokens_per_rank
    )
    best, one_tps = _fastest(one)
    return _bound(
        path, one_tps, ranks=ranks, medians=medians, layout=best,
        tokens_key="bound_tokens_per_s", speedup_key="bound_speedup_vs_static4",
    )  # fmt: skip


def baseline(medians: dict[str, float]) -> tuple[str, float] | None:
    """The static CP 4 layout every speedup is over: the fastest measured one (``static4``, ``static4+graph``,
    ``static4+te``...), and its median tokens/s; None without one.

    Why the fastest: the baseline may use what the measured layouts use. Now that CP-4 micro-batches can replay
    a decoder graph (``static4+graph``), a graphed dynamic layout over an eager static one would credit the
    graphs to dynamic CP.
    """
    static = {k: v for k, v in medians.items() if layout_options(k)[0] == "static4"}
    if not static:
        return None
    best = max(static, key=static.__getitem__)
    return best, static[best]


def _fastest(one: dict[str, Any]) -> tuple[str, float]:
    """The layout of a one-GPU record with the highest median tokens/s, and that median."""
    medians = {layout: statistics.median(values) for layout, values in one["repeats"].items()}
    best = max(medians, key=medians.__getitem__)
    return best, medians[best]


def _bound(
    path: Path,
    one_tps: float,
    *,
    ranks: int,
    medians: dict[str, float],
    layout: str,
    tokens_key: str,
    speedup_key: str,
) -> dict[str, Any]:
    """One GPU's median tokens/s x ``ranks`` (``tokens_key``), over the static CP 4 baseline's median
    (``speedup_key``, :func:`baseline`)."""
    total, base = one_tps * ranks, baseline(medians)
    return {
        "source": str(path),
        "one_gpu_layout": layout,
        "one_gpu_tokens_per_s": one_tps,
        tokens_key: total,
        speedup_key: total / base[1] if base else None,
    }


def write_results(
    args: argparse.Namespace,
    lengths: dict[str, Any],
    results: dict[str, Any],
    repeats: dict[str, list[float]],
    *,
    turns: int,
) -> None:
    """The record after ``turns`` finished turns (rewritten after each); targets.json only after the last.
    ``lengths``: :func:`lengths_summary` of the run's batches."""
    medians = {k: statistics.median(v) for k, v in repeats.items()}
    base_layout, base = baseline(medians) or (None, None)
    bound = ideal_bound(args, lengths, medians, ranks=dist.get_world_size())
    record = write_record(
        args.out,
        benchmark="dyncp_longtail",
        device=None if args.device == "cuda" else "cpu (smoke run)",
        extra_versions=("transformer_engine",),  # the ``+te`` layouts need it
        config={
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"},
            "lengths": lengths,
        },
        numbers={
            "gpus": dist.get_world_size(),
            # Transport settings change what CP communication costs (NCCL_P2P_DISABLE: no NVLink).
            "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
            "results": results,
            "repeats": repeats,
            "turns_completed": turns,
            # every speedup is over the fastest static CP 4 layout measured (baseline())
            "baseline_layout": base_layout,
            "speedup_vs_static4": {
                k: v["tokens_per_s"] / results[base_layout]["tokens_per_s"]
                for k, v in results.items()
                if base_layout and "tokens_per_s" in results[base_layout] and "tokens_per_s" in v
            },
            "speedup_vs_static4_median": {k: v / base for k, v in medians.items()} if base else {},
            "ideal_bound": bound,
            "same_budget_bound": same_budget_bound(args, lengths, medians, ranks=dist.get_world_size()),
        },
    )
    print(
        json.dumps(record["speedup_vs_static4_median"]),
        json.dumps(bound),
        json.dumps(record["same_budget_bound"]),
        flush=True,
    )
    if args.targets and turns == args.repeats:  # a target from fewer repeats than asked is never written
        if not base or args.target_layout not in medians or bound is None:
            raise SystemExit(
                f"--targets needs a static4 layout, the {args.target_layout} layout and --ideal-from"
            )
        update_target(
            "dyncp_megatron_workload_speedup",
            medians[args.target_layout] / base,
            goal=">= 1.3x over static CP 4 and within 10% of the ideal bound (95% of it if the bound < 1.3x)",
            source=args.out,
            record=record,
        )
        update_target(
            "dyncp_ideal_bound_speedup",
            bound["ideal_bound_speedup_vs_static4"],
            goal="measured bound (one GPU x ranks, no communication, perfect balance) over static CP 4",
            source=args.out,
            record=record,
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="base")
    parser.add_argument(
        "--model",
        default="preset",
        choices=("preset", "qwen3-30b-a3b"),
        help="preset: the Qwen2 preset (--preset); qwen3-30b-a3b: Qwen3-30B-A3B's MoE shape (--layers of it)",
    )
    parser.add_argument("--ep", type=int, default=1, help="expert_model_parallel_size (MoE models)")
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
    parser.add_argument("--layers", type=int, default=None, help="replace the preset's number of layers")
    parser.add_argument("--median", type=float, default=2048.0)
    parser.add_argument(
        "--mean", type=float, default=None, help="set the lognormal's mean instead of its median"
    )
    parser.add_argument("--repeats", type=int, default=1, help="run the layouts this many times, in turn")
    parser.add_argument(
        "--ideal-from",
        type=Path,
        default=None,
        help="the one-GPU no-CP record of the same batches (micro-batch budget = this run's pool budget)",
    )
    parser.add_argument(
        "--budget-bound-from",
        type=Path,
        default=None,
        help="a one-GPU record of the same batches at this run's --tokens-per-rank (the same-budget bound)",
    )
    parser.add_argument("--targets", action="store_true", help="store the speedups in results/targets.json")
    parser.add_argument(
        "--target-layout", default="dynamic", help="the layout whose speedup over static4 --targets stores"
    )
    parser.add_argument(
        "--graph-tokens",
        type=int,
        default=None,
        help="+graph layouts: the graph's token budget (default: per rank)",
    )
    parser.add_argument("--graph-sequences", type=int, default=64, help="+graph layouts: sequence slots")
    parser.add_argument("--sigma", type=float, default=1.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-len", type=int, default=256, help="lengths are clipped to [min, max]")
    parser.add_argument("--max-len", type=int, default=32768)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run (debug backend)"
    )
    args = parser.parse_args()
    if args.mean is not None:  # a lognormal's mean is exp(mu + sigma^2 / 2), its median exp(mu)
        args.median = args.mean / math.exp(args.sigma**2 / 2)

    from verl_mcore_utils.parallel import destroy_parallel, init_parallel

    dims = init_parallel(device=args.device, expert_model_parallel_size=args.ep)
    steps_lens = lengths_for_steps(
        steps=args.steps,
        tokens_per_step=args.tokens_per_step,
        median=args.median,
        sigma=args.sigma,
        seed=args.seed,
        min_len=args.min_len,
        max_len=args.max_len,
    )
    # the bound records are checked on every rank before any layout runs, so a wrong one stops the whole group at
    # once (found by rank 0 alone when it writes the record, it would leave the others in the next collectives)
    lengths = lengths_summary(args, steps_lens)
    ideal_bound(args, lengths, {}, ranks=dist.get_world_size())
    same_budget_bound(args, lengths, {}, ranks=dist.get_world_size())
    results: dict[str, Any] = {}
    repeats: dict[str, list[float]] = {}
    for turn in range(args.repeats):  # A/B/A/B...: drift of the lease hits every layout alike
        for name in args.layouts.split(","):
            try:
                run = run_layout(name, args, steps_lens, dims)
            except torch.OutOfMemoryError as err:  # "no CP where it fits": record, do not hide
                run = {"layout": name, "error": f"out of memory: {str(err).splitlines()[0]}"}
                gc.collect()
                torch.cuda.empty_cache()
            results.setdefault(name, run)
            if "tokens_per_s" in run:
                repeats.setdefault(name, []).append(run["tokens_per_s"])
            if dist.get_rank() == 0:
                print(turn, name, json.dumps({k: v for k, v in run.items() if k != "losses"}), flush=True)
        if dist.get_rank() == 0:  # after every turn: a run cut by a time limit keeps its finished turns
            write_results(args, lengths, results, repeats, turns=turn + 1)
    destroy_parallel()
    os._exit(0)


if __name__ == "__main__":
    main()
