"""Dynamic-CP planner quality on ONE GPU: every simulated CP rank's share run in turn, the step's time the max.

    cd benchmarks && python3 dyncp_plan_sim_gpu.py --out results/dyncp_plan_sim_1.5b_h100.json

Why: the planner's job is balance. Whether its plans are good can be measured without 4 GPUs: for each
micro-batch, each DP x CP rank's share (its zigzag chunks of the sequences of its CP block) is run on the one
GPU, one rank after the other, and the micro-batch costs what its slowest rank costs (the ranks meet in the
CP collectives and regroup at the next micro-batch); a step costs the sum over its micro-batches.

A rank's share of one transformer layer, forward + backward, at the Qwen2.5-1.5B shape (bf16): the dense
part (QKV, attention output and SwiGLU MLP matmuls on its local tokens) and verl-dyncp's attention kernel on
exactly the chunks and key streams verl-dyncp builds for that rank (``build_thd_layout`` + the varlen flash
kernel; the K/V all-gather replaced by its result). The step scales that by the number of layers and adds
the LM head on the local tokens. Communication cannot be measured on one GPU: it is added from a model,
the K/V all-gather (forward) and reduce-scatter (backward) of ``(k - 1) / k`` of the block's K/V per layer
at ``--link-gb-s`` (NVLink-class default); the figures are given with and without it.

Plans compared on the same micro-batches (first-fit decreasing at ``--tokens-per-rank`` x pool tokens):
static CP 4, no CP, verl-dyncp's dynamic plan (k per micro-batch from ``--max-seqlen``, LPT over groups with
``WorkloadModel.for_transformer``), its mixed plan, and on small cases (``--small-cases`` micro-batches of
5-7 sequences) the best plan found by exhaustive search over every aligned block layout of the 4 ranks and
every assignment of sequences to blocks (memory budget respected), ranked by the measured per-sequence
costs and then measured like the others. Finally the workload model is fitted to the measured per-sequence
costs (``quadratic * L^2 + linear * L``) and the fitted ratio reported beside ``for_transformer``'s ``12 h``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

H, F, LAYERS, HEADS, KV, HD, VOCAB = 1536, 8960, 28, 12, 2, 128, 151936  # Qwen2.5-1.5B


def lognormal_lengths(*, count: int, median: float, sigma: float, lo: int, hi: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(np.clip(rng.lognormal(math.log(median), sigma), lo, hi)) for _ in range(count)]


class Timer:
    """Median CUDA time of fwd + bwd callables, memoised by a key (the same share costs the same)."""

    def __init__(self, repeat: int) -> None:
        self.repeat = repeat
        self.cache: dict[tuple, float] = {}

    def __call__(self, key: tuple, fn) -> float:
        if key not in self.cache:
            fn()
            times = []
            for _ in range(self.repeat):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            self.cache[key] = statistics.median(times)
        return self.cache[key]


class Layer:
    """Weights of one layer (and the LM head) at the model's shape, and fwd + bwd of a rank's share."""

    def __init__(self) -> None:
        kw = {"device": "cuda", "dtype": torch.bfloat16}
        self.w_qkv = (torch.randn(H, H + 2 * KV * HD, **kw) * 0.02).requires_grad_()
        self.w_o = (torch.randn(H, H, **kw) * 0.02).requires_grad_()
        self.w_up = (torch.randn(H, 2 * F, **kw) * 0.02).requires_grad_()
        self.w_down = (torch.randn(F, H, **kw) * 0.02).requires_grad_()
        self.w_head = torch.randn(VOCAB, H, **kw) * 0.02

    def dense(self, tokens: int) -> None:
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        qkv = x @ self.w_qkv
        out = qkv[:, :H] @ self.w_o
        gate, up = (out @ self.w_up).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ self.w_down
        y.backward(torch.ones_like(y))

    def head(self, tokens: int) -> None:
        """LM head fwd + bwd in 4096-token chunks (the fused head's matmuls)."""
        w = self.w_head.detach().requires_grad_()
        for start in range(0, tokens, 4096):
            x = torch.randn(
                min(4096, tokens - start), H, device="cuda", dtype=torch.bfloat16, requires_grad=True
            )
            logits = x @ w.t()
            logits.backward(torch.ones_like(logits))

    @staticmethod
    def attention(layout) -> None:
        from verl_dyncp.thd_attention import _segmented_attention, _varlen_attention

        t_q = layout.num_local_tokens
        t_k = int(layout.cu_seqlens_k[-1]) if layout.cp_size > 1 else t_q
        kw = {"device": "cuda", "dtype": torch.bfloat16, "requires_grad": True}
        q = torch.randn(t_q, HEADS, HD, **kw)
        k = torch.randn(t_k, KV, HD, **kw)
        v = torch.randn(t_k, KV, HD, **kw)
        # the engine's kernels: CP 1 dense cuDNN per long sequence + varlen for the rest, CP > 1 varlen
        attend = _segmented_attention if layout.cp_size == 1 else _varlen_attention
        out = attend(q, k, v, layout=layout, scale=None)
        out.backward(torch.ones_like(out))


def rank_layouts(lens: list[int], k: int) -> list:
    """verl-dyncp's layout of each of the ``k`` ranks of a block running ``lens`` (padded to 2k)."""
    from verl_dyncp.thd_attention import build_thd_layout

    padded = [n if k == 1 else -(-n // (2 * k)) * 2 * k for n in lens]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    cu_p = torch.tensor([0, *itertools.accumulate(padded)], dtype=torch.int32)
    return [
        build_thd_layout(cu_seqlens=cu, cu_seqlens_padded=cu_p, cp_size=k, cp_rank=r, device="cuda")
        for r in range(k)
    ]


class Simulator:
    def __init__(self, *, repeat: int, link_gb_s: float) -> None:
        self.layer = Layer()
        self.timer = Timer(repeat)
        self.link = link_gb_s * 1e9

    def block_rank_seconds(self, lens: list[int], k: int) -> tuple[float, float]:
        """(compute, communication) seconds of the slowest rank of a k-rank block running ``lens``."""
        if not lens:
            return 0.0, 0.0
        worst = 0.0
        for layout in rank_layouts(lens, k):
            key = ("attn", k, tuple(layout.padded_lens), layout.cp_rank)
            attn = self.timer(key, lambda layout=layout: Layer.attention(layout))
            t = layout.num_local_tokens
            dense = self.timer(("dense", t), lambda t=t: self.layer.dense(t))
            head = self.timer(("head", t), lambda t=t: self.layer.head(t))
            worst = max(worst, LAYERS * (attn + dense) + head)
        kv_bytes = sum(lens) * 2 * KV * HD * 2  # K and V of the block, bf16
        comm = (
            0.0 if k == 1 else LAYERS * 2 * (k - 1) / k * kv_bytes / self.link
        )  # all-gather + reduce-scatter
        return worst, comm

    def micro_batch(self, blocks: list[tuple[int, list[int]]]) -> dict[str, float]:
        """Blocks as (size, lengths): the micro-batch's time is its slowest block's slowest rank."""
        parts = [self.block_rank_seconds(lens, k) for k, lens in blocks]
        return {
            "compute": max(c for c, _ in parts),
            "with_comm": max(c + m for c, m in parts),
        }


def plan_blocks(
    name: str, lens: list[int], *, pool: int, max_seqlen: int, workload
) -> list[tuple[int, list[int]]]:
    from verl_dyncp.planner import plan_dynamic_cp, plan_mixed_cp

    if name == "static4":
        plan = plan_dynamic_cp(lens, dp_cp_size=pool, static_cp_size=4, workload=workload)
    elif name == "none":
        plan = plan_dynamic_cp(lens, dp_cp_size=pool, static_cp_size=1, workload=workload)
    elif name == "dynamic":
        plan = plan_dynamic_cp(lens, dp_cp_size=pool, max_seqlen_per_dp_cp_rank=max_seqlen, workload=workload)
    elif name == "dynamic_mixed":
        plan = plan_mixed_cp(lens, dp_cp_size=pool, max_seqlen_per_dp_cp_rank=max_seqlen, workload=workload)
    else:
        raise ValueError(name)
    return [(b.size, [lens[i] for i in b.sequences]) for b in plan.blocks]


BLOCK_LAYOUTS = ([4], [2, 2], [2, 1, 1], [1, 1, 1, 1])  # every aligned layout of 4 ranks (up to symmetry)


def exhaustive_best(
    sim: Simulator, lens: list[int], *, budget: int
) -> tuple[list[tuple[int, list[int]]], float]:
    """The plan with the smallest slowest-rank cost (measured compute + modelled communication, per sequence,
    summed over a block's sequences) over every block layout and assignment within the memory budget."""

    costs: dict[tuple[int, int], float] = {}

    def seq_cost(n: int, k: int) -> float:
        if (n, k) not in costs:
            costs[(n, k)] = sum(sim.block_rank_seconds([n], k))  # compute + modelled communication
        return costs[(n, k)]

    best, best_cost = None, math.inf
    for sizes in BLOCK_LAYOUTS:
        for assign in itertools.product(range(len(sizes)), repeat=len(lens)):
            groups: list[list[int]] = [[] for _ in sizes]
            for n, b in zip(lens, assign, strict=True):
                groups[b].append(n)
            if any(-(-sum(g) // k) > budget for g, k in zip(groups, sizes, strict=True)):
                continue
            cost = max(sum(seq_cost(n, k) for n in g) for g, k in zip(groups, sizes, strict=True))
            if cost < best_cost:
                best, best_cost = [(k, g) for k, g in zip(sizes, groups, strict=True)], cost
    assert best is not None
    return best, best_cost


def fit_workload(sim: Simulator, lengths: list[int]) -> dict[str, float]:
    """Least-squares ``a L^2 + b L`` to the measured one-rank cost of single sequences: b / a vs 12 h."""
    ys = [sim.block_rank_seconds([n], 1)[0] for n in lengths]
    x = np.array([[n * n, n] for n in lengths], dtype=np.float64)
    (a, b), *_ = np.linalg.lstsq(x, np.array(ys), rcond=None)
    return {
        "quadratic": float(a),
        "linear": float(b),
        "linear_over_quadratic": float(b / a),
        "for_transformer": 12 * H,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pool", type=int, default=4)
    parser.add_argument("--tokens-per-rank", type=int, default=16384)
    parser.add_argument("--max-seqlen", type=int, default=8192)
    parser.add_argument("--median", type=float, default=2048.0)
    parser.add_argument("--sigma", type=float, default=1.2)
    parser.add_argument("--sequences", type=int, default=96)
    parser.add_argument("--max-len", type=int, default=32768)
    parser.add_argument("--small-cases", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--link-gb-s", type=float, default=300.0)
    args = parser.parse_args()

    from verl_dyncp.planner import WorkloadModel
    from verl_engine.packed import split_packed_micro_batches

    workload = WorkloadModel.for_transformer(hidden_size=H)
    sim = Simulator(repeat=args.repeat, link_gb_s=args.link_gb_s)
    lens = lognormal_lengths(
        count=args.sequences, median=args.median, sigma=args.sigma, lo=256, hi=args.max_len, seed=0
    )
    micro = split_packed_micro_batches(lens, max_tokens=args.tokens_per_rank * args.pool)
    layouts = ["static4", "dynamic", "dynamic_mixed", "none"]
    totals: dict[str, dict[str, float]] = {}
    for name in layouts:
        acc = {"compute": 0.0, "with_comm": 0.0}
        try:
            for idx in micro:
                mb_lens = [lens[i] for i in idx]
                if name == "none" and max(mb_lens) > args.tokens_per_rank:
                    raise ValueError("a sequence exceeds one rank's budget")
                t = sim.micro_batch(
                    plan_blocks(name, mb_lens, pool=args.pool, max_seqlen=args.max_seqlen, workload=workload)
                )
                for key in acc:
                    acc[key] += t[key]
        except ValueError as err:
            totals[name] = {"error": str(err)}
            continue
        totals[name] = acc
        print(name, acc, flush=True)
    static = totals["static4"]
    speedups = {
        name: {k: static[k] / v[k] for k in ("compute", "with_comm")}
        for name, v in totals.items()
        if "error" not in v
    }

    # small cases: planner vs the exhaustive best
    small = []
    rng = np.random.default_rng(1)
    for case in range(args.small_cases):
        count = int(rng.integers(5, 8))
        case_lens = lognormal_lengths(
            count=count, median=args.median, sigma=args.sigma, lo=256, hi=args.max_len, seed=100 + case
        )
        while sum(case_lens) > args.tokens_per_rank * args.pool:
            case_lens.pop()
        best_plan, _ = exhaustive_best(sim, case_lens, budget=args.tokens_per_rank)
        best = sim.micro_batch(best_plan)["compute"]
        row = {"lengths": case_lens, "best_plan": [[k, g] for k, g in best_plan], "best_seconds": best}
        for name in ("dynamic", "dynamic_mixed", "static4"):
            blocks = plan_blocks(
                name, case_lens, pool=args.pool, max_seqlen=args.max_seqlen, workload=workload
            )
            t = sim.micro_batch(blocks)["compute"]
            row[name] = {"plan": [[k, g] for k, g in blocks], "seconds": t, "over_best": t / best}
        small.append(row)
        print(json.dumps(row, default=float), flush=True)

    fit = fit_workload(sim, [256, 512, 1024, 2048, 4096, 8192, 16384])
    record = {
        "benchmark": "dyncp_plan_sim_gpu",
        "device": torch.cuda.get_device_name(),
        "versions": {p: metadata.version(p) for p in ("torch", "verl-dyncp", "verl-engine")},
        "config": {
            **{k: v for k, v in vars(args).items() if k != "out"},
            "model": "Qwen2.5-1.5B layer shapes, bf16, 28 layers + LM head",
            "lengths": {
                "count": len(lens),
                "min": min(lens),
                "median": int(np.median(lens)),
                "max": max(lens),
                "tokens": sum(lens),
            },
            "micro_batches": len(micro),
            "communication": f"modelled: K/V all-gather + reduce-scatter per layer at {args.link_gb_s} GB/s",
        },
        "step_seconds": totals,
        "speedup_vs_static_cp4": speedups,
        "small_cases": small,
        "workload_fit": fit,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2, default=float) + "\n")
    print(
        json.dumps(
            {k: record[k] for k in ("step_seconds", "speedup_vs_static_cp4", "workload_fit")},
            indent=2,
            default=float,
        )
    )


if __name__ == "__main__":
    main()
