"""Expert MLPs without Transformer Engine: grouped experts (``torch._grouped_mm``) vs megatron-core's sequential
experts vs a dense SwiGLU MLP of the same active FLOPs, one GPU, bf16.

    cd benchmarks && BENCH_COMMIT=SHA python3 moe_experts_gpu.py --out results/moe_experts_h100.json

Qwen3-30B-A3B's expert shape: hidden 2048, expert FFN 768, top-8 of 128 experts. Cases (``tokens`` per rank):
all 128 experts on the rank (EP 1: ``8 x tokens`` expert rows), and the 32 local experts of EP 4 (the rank
receives ``8 x tokens / 4`` rows on average). Routing: per token, 8 distinct experts drawn from a slightly
imbalanced popularity (log-normal, sigma 0.3: the busiest expert gets about 2x the quietest), rows sorted by
expert as the dispatcher hands them over, routing probabilities uniform in (0, 1).

Timed, for each case, forward + backward (input, probability and weight gradients) of

* ``grouped``: :class:`verl_mcore_utils.grouped_experts.GroupedExperts` (three grouped GEMMs each way);
* ``sequential``: megatron-core's ``SequentialMLP`` (one MLP per expert; ``tokens_per_expert`` on the host,
  as its ``.tolist()`` needs);
* ``dense``: megatron-core's ``MLP`` with FFN ``8 x 768 = 6144`` over ``rows / 8`` tokens: the same FLOPs as
  the expert rows, in two large GEMMs (the bound grouped experts can approach).

CUDA events around each iteration, 3 warm-up iterations, median of ``--iters``; peak memory is the
``max_memory_allocated`` above the memory held before the iteration (activations + gradients). Also the
relative difference of grouped vs sequential outputs (bf16). Needs torch, megatron-core and verl-mcore-utils.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from _record import write_record

HIDDEN, FFN, TOPK = 2048, 768, 8
CASES = {  # name: (local experts, global experts, tokens per rank)
    "ep1_e128_t4096": (128, 128, 4096),
    "ep1_e128_t16384": (128, 128, 16384),
    "ep4_e32_t16384": (32, 128, 16384),
}


def tf_config(num_local: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=16, ffn_hidden_size=TOPK * FFN,
        moe_ffn_hidden_size=FFN, num_moe_experts=num_local, moe_router_topk=TOPK, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False,
        gradient_accumulation_fusion=False, bf16=True, params_dtype=torch.bfloat16,
        use_cpu_initialization=False, hidden_dropout=0.0,
    )  # fmt: skip


def routing(num_local: int, num_global: int, tokens: int, seed: int) -> torch.Tensor:
    """Rows per local expert for one rank holding experts ``0 .. num_local - 1``.

    Each of the ``num_global / num_local`` ranks sends its ``tokens`` tokens' choices (8 distinct experts per
    token, by popularity); this rank receives the rows of its own experts.
    """
    gen = torch.Generator().manual_seed(seed)
    popularity = torch.exp(0.3 * torch.randn(num_global, generator=gen))
    senders = tokens * (num_global // num_local)
    choice = torch.multinomial(popularity.expand(senders, num_global), TOPK, generator=gen)
    return torch.bincount(choice.flatten(), minlength=num_global)[:num_local]


def time_fwd_bwd(step, iters: int) -> tuple[float, float]:
    """Median milliseconds of ``step()`` (forward + backward) and its peak memory above the start, in GiB."""
    times = []
    for i in range(iters + 3):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times), peak


def bench_case(name: str, iters: int) -> dict:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from verl_mcore_utils.grouped_experts import GroupedExperts

    num_local, num_global, tokens = CASES[name]
    config = tf_config(num_local)
    sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    sequential = SequentialMLP(num_local, config, submodules=sub, pg_collection=pgs)
    grouped = GroupedExperts(num_local, config)
    with torch.no_grad():  # the same weights
        grouped.linear_fc1_weight.copy_(torch.stack([e.linear_fc1.weight for e in sequential.local_experts]))
        grouped.linear_fc2_weight.copy_(torch.stack([e.linear_fc2.weight for e in sequential.local_experts]))
    dense = MLP(config, sub, ffn_hidden_size=TOPK * FFN, tp_group=pgs.tp).cuda()

    counts = routing(num_local, num_global, tokens, seed=0)
    rows = int(counts.sum())
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    probs = torch.rand(rows, device="cuda", dtype=torch.float32, generator=gen).requires_grad_(True)
    grad = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    dense_rows = rows // TOPK
    xd = torch.randn(dense_rows, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(
        True
    )
    gd = torch.randn(dense_rows, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    counts_gpu, counts_cpu = counts.cuda(), counts.clone()

    def experts_step(module, tokens_per_expert):
        def step():
            module.zero_grad(set_to_none=True)
            x.grad = probs.grad = None
            out, _ = module(x, tokens_per_expert, probs)
            out.backward(grad)

        return step

    def dense_step():
        dense.zero_grad(set_to_none=True)
        xd.grad = None
        out, _ = dense(xd)
        out.backward(gd)

    with torch.no_grad():
        ref, _ = sequential(x, counts_cpu, probs)
        got, _ = grouped(x, counts_gpu, probs)
        rel = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
    flops = 18 * rows * HIDDEN * FFN  # fc1 (2F x H) + fc2 (H x F): 6 F H per row forward, x3 with backward
    out: dict = {
        "rows": rows,
        "max_rows_per_expert": int(counts.max()),
        "min_rows_per_expert": int(counts.min()),
    }
    for label, step in (
        ("grouped", experts_step(grouped, counts_gpu)),
        ("sequential", experts_step(sequential, counts_cpu)),
        ("dense", dense_step),
    ):
        ms, peak = time_fwd_bwd(step, iters)
        out[label] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1), "peak_gib": round(peak, 3)}
    out["speedup_vs_sequential"] = round(out["sequential"]["ms"] / out["grouped"]["ms"], 2)
    out["grouped_over_dense"] = round(out["grouped"]["ms"] / out["dense"]["ms"], 2)
    out["grouped_vs_sequential_rel_diff_bf16"] = rel
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    from megatron.core import tensor_parallel

    from verl_mcore_utils.parallel import init_parallel

    init_parallel(device="cuda")
    # megatron-core initialises GPU weights under its RNG tracker
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    results = {}
    for name in args.cases:
        results[name] = bench_case(name, args.iters)
        print(name, results[name], flush=True)
        torch.cuda.empty_cache()
    write_record(
        args.out,
        benchmark="moe_experts_gpu",
        config={
            "hidden": HIDDEN,
            "moe_ffn_hidden": FFN,
            "topk": TOPK,
            "dense_ffn": TOPK * FFN,
            "dtype": "bfloat16",
            "cases": {
                n: dict(zip(("local_experts", "global_experts", "tokens"), CASES[n], strict=True))
                for n in args.cases
            },
            "routing": "8 distinct experts per token, log-normal popularity sigma 0.3",
            "iters": args.iters,
            "warmup": 3,
        },
        numbers={"results": results},
    )


if __name__ == "__main__":
    main()
