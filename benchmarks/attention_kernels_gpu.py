"""Causal attention kernels reachable through PyTorch alone, on packed (THD) rows: which is fastest.

    cd benchmarks && python3 attention_kernels_gpu.py --out results/attention_kernels_h100.json

Why: without Transformer Engine the engine's attention is torch's ``varlen_attn``; on Hopper the cuDNN
SDPA backend may be faster. Per packed row (Qwen2.5-1.5B heads: 12 query heads, 2 KV heads, head dim 128,
bf16), forward + backward of:

* ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` over the row (what verl-dyncp uses at CP 1);
* ``cudnn`` / ``flash``: ``scaled_dot_product_attention`` with that backend forced, one call per sequence
  of the row (q/k/v as strided views of the THD tensors, GQA by ``enable_gqa`` or an expanded view);
* ``cudnn_gqa_expand``: the same with K/V expanded to the query heads (no copy) where enable_gqa is refused.

Each variant's output and input gradients are compared with a float32 reference (relative L2 error);
times are medians of CUDA-event timings. FLOPs are the causal ones (half the s^2 term).
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from _record import write_record
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, KV, HD = 12, 2, 128

ROWS = {  # packed rows: sequence lengths in one micro-batch
    "1x4096": [4096],
    "4096 varied (4)": [2048, 1024, 768, 256],
    "4096 varied (9)": [1500, 900, 600, 400, 300, 150, 100, 90, 56],
    "1x16384": [16384],
    "16384 varied (5)": [8192, 4096, 2048, 1536, 512],
}


def timed(fn, *, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def per_sequence(q, k, v, cu: list[int], *, backend: SDPBackend, gqa: str) -> torch.Tensor:
    outs = []
    with sdpa_kernel([backend]):
        for a, b in itertools.pairwise(cu):
            qi, ki, vi = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, s, D] views
            if gqa == "expand":
                reps = HEADS // KV
                ki = ki[:, :, None].expand(1, KV, reps, b - a, HD).reshape(1, HEADS, b - a, HD)
                vi = vi[:, :, None].expand(1, KV, reps, b - a, HD).reshape(1, HEADS, b - a, HD)
                out = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True)
            else:
                out = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
            outs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0)


def varlen(q, k, v, cu: list[int]) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    cu_t = torch.tensor(cu, device=q.device, dtype=torch.int32)
    m = max(b - a for a, b in itertools.pairwise(cu))
    params = inspect.signature(varlen_attn).parameters
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    else:
        k, v = k.repeat_interleave(HEADS // KV, dim=1), v.repeat_interleave(HEADS // KV, dim=1)
    return varlen_attn(q, k, v, cu_t, cu_t, m, m, **kwargs)


def reference(q, k, v, cu: list[int]) -> torch.Tensor:
    outs = []
    for a, b in itertools.pairwise(cu):
        qi, ki, vi = (t[a:b].float().transpose(0, 1) for t in (q, k, v))
        ki, vi = ki.repeat_interleave(HEADS // KV, 0), vi.repeat_interleave(HEADS // KV, 0)
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True).transpose(0, 1))
    return torch.cat(outs, dim=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    variants = {
        "varlen": varlen,
        "cudnn": lambda q, k, v, cu: per_sequence(
            q, k, v, cu, backend=SDPBackend.CUDNN_ATTENTION, gqa="flag"
        ),
        "cudnn_gqa_expand": lambda q, k, v, cu: per_sequence(
            q, k, v, cu, backend=SDPBackend.CUDNN_ATTENTION, gqa="expand"
        ),
        "flash": lambda q, k, v, cu: per_sequence(
            q, k, v, cu, backend=SDPBackend.FLASH_ATTENTION, gqa="flag"
        ),
    }
    results = []
    for row, lengths in ROWS.items():
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        t = cu[-1]
        q = torch.randn(t, HEADS, HD, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(t, KV, HD, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(t, KV, HD, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(t, HEADS, HD, device="cuda", dtype=torch.bfloat16)
        q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
        ref = reference(q32, k32, v32, cu)
        ref.backward(g.float())
        causal_flops = sum(2 * 2 * n * n * HEADS * HD for n in lengths)  # fwd, causal half of QK^T and PV
        for name, fn in variants.items():
            record = {"row": row, "lengths": lengths, "kernel": name}
            try:
                for x in (q, k, v):
                    x.grad = None
                out = fn(q, k, v, cu)
                out.backward(g)
                record["rel_err_out"] = float((out.float() - ref).norm() / ref.norm())
                record["rel_err_dq"] = float((q.grad.float() - q32.grad).norm() / q32.grad.norm())
                record["rel_err_dk"] = float((k.grad.float() - k32.grad).norm() / k32.grad.norm())

                def fwd(fn=fn, args=(q, k, v, cu)):
                    with torch.no_grad():
                        fn(*args)

                def fwd_bwd(fn=fn, args=(q, k, v, cu), g=g):
                    fn(*args).backward(g)

                record["fwd_ms"] = timed(fwd, repeat=args.repeat) * 1e3
                record["fwd_bwd_ms"] = timed(fwd_bwd, repeat=args.repeat) * 1e3
                record["fwd_tflops"] = causal_flops / (record["fwd_ms"] / 1e3) / 1e12
                record["fwd_bwd_tflops"] = 3.5 * causal_flops / (record["fwd_bwd_ms"] / 1e3) / 1e12
            except Exception as exc:  # a backend that refuses these inputs: record why
                record["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            results.append(record)
            print(json.dumps(record), flush=True)
    write_record(
        args.out,
        benchmark="attention_kernels_gpu",
        config={k: v for k, v in vars(args).items() if k != "out"},
        more_versions={"cudnn": torch.backends.cudnn.version()},
        numbers={
            "shape": {"heads": HEADS, "kv_heads": KV, "head_dim": HD, "dtype": "bfloat16"},
            "flops": "causal: 4 n^2 H D forward, 3.5 x that forward + backward",
            "results": results,
        },
    )
    print(f"{'row':<18} {'kernel':<18} {'fwd ms':>8} {'f+b ms':>8} {'f+b TF/s':>9} {'err':>8}")
    for r in results:
        if "error" in r:
            print(f"{r['row']:<18} {r['kernel']:<18} {r['error'][:60]}")
        else:
            print(
                f"{r['row']:<18} {r['kernel']:<18} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:8.3f}"
                f" {r['fwd_bwd_tflops']:9.1f} {max(r['rel_err_out'], r['rel_err_dq'], r['rel_err_dk']):8.1e}"
            )


if __name__ == "__main__":
    main()
