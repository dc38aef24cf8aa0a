"""Where the GPU waits during the engine's steps: idle gaps between kernels and what the host did then.

    cd benchmarks && python3 gpu_idle_gpu.py --out results/gpu_idle_1.5b_h100.json [--override key=value ...]

Why: the SFT step's kernels add up to less than its wall time; the difference is time the GPU sits idle
waiting for the host (Python, launches, synchronising copies). One step (8 packed 4096-token rows) and
one log-prob pass are traced with torch's profiler (no Python stacks, so the host runs at about its
normal speed); from the trace: wall time, kernel-busy time (union of kernel intervals), idle time, the
largest gaps with the host-side operations that overlap them, and time spent in synchronising CUDA
runtime calls. The gzipped chrome trace is written beside the JSON.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from _common import SHAPES, build, lengths_for, make_batch, train_step
from _record import write_record

SYNCING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaEventSynchronize")


KERNEL_KINDS = (  # first match wins; names of cuBLAS / cuDNN / flash / torch / Triton kernels
    ("matmul", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")),
    ("attention", ("fmha", "flash", "attn", "cudnn")),
    ("optimizer", ("adam", "multi_tensor", "_foreach")),
    ("norm", ("norm",)),
    ("copy / cast", ("copy", "cast", "memcpy", "memset", "fill", "cat")),
    ("triton (ours / compiled)", ("triton",)),
    ("reduction", ("reduce",)),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, needles in KERNEL_KINDS:
        if any(n in low for n in needles):
            return kind
    return "elementwise / other"


def analyse(trace: dict, *, top: int) -> dict:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel")
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    busy, gaps, cur_s, cur_e = 0.0, [], None, None
    for s, e in kernels:
        if cur_e is None:
            cur_s, cur_e = s, e
        elif s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, cur_e, s))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
        gaps.append((kernels[0][0] - start, start, kernels[0][0]))
        gaps.append((end - cur_e, cur_e, end))
    gaps.sort(reverse=True)

    def overlapping(a: float, b: float) -> list[str]:
        names = collections.Counter()
        for e in host:
            if e["ts"] < b and e["ts"] + e["dur"] > a and e["dur"] < (end - start) * 0.5:
                names[e["name"]] += 1
        return [n for n, _ in names.most_common(8)]

    sync_time = collections.Counter()
    sync_count = collections.Counter()
    for e in runtime:
        if any(e["name"].startswith(s) for s in SYNCING):
            sync_time[e["name"]] += e["dur"]
            sync_count[e["name"]] += 1
    by_kind = collections.Counter()
    for e in events:
        if e.get("cat") == "kernel":
            by_kind[kernel_kind(e["name"])] += e["dur"]
    hist = collections.Counter()
    for d, _, _ in gaps:
        bucket = "<10us" if d < 10 else "10-100us" if d < 100 else "0.1-1ms" if d < 1000 else ">1ms"
        hist[bucket] += d
    return {
        "wall_ms": (end - start) / 1e3,
        "kernel_busy_ms": busy / 1e3,
        "idle_ms": (end - start - busy) / 1e3,
        "idle_by_gap_size_ms": {k: v / 1e3 for k, v in hist.items()},
        "kernel_ms_by_kind": {k: v / 1e3 for k, v in by_kind.most_common()},
        "gaps": len(gaps),
        "largest_gaps": [
            {"ms": d / 1e3, "at_ms": (a - start) / 1e3, "host_ops": overlapping(a, b)}
            for d, a, b in gaps[:top]
        ],
        "syncing_runtime_calls": {k: {"count": sync_count[k], "ms": sync_time[k] / 1e3} for k in sync_time},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--fused", action="store_true")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--override", nargs="*", default=[])
    parser.add_argument("--max-token-len", type=int, default=None, help="tokens per packed micro-batch")
    args = parser.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from verl_engine.losses import sft_loss
    from verl_mcore_utils.parallel import init_parallel

    init_parallel(device="cuda")
    engine, _ = build(
        args.shape,
        seq=args.seq,
        fused=args.fused,
        sequences=8,
        extra=tuple(args.override),
        max_token_len=args.max_token_len,
    )
    batch = make_batch(
        lengths_for("fixed", count=8, seq=args.seq, seed=0), vocab=SHAPES[args.shape][5], seed=0
    )
    sections: dict = {}
    for name, run, mode in (
        ("sft_step", partial(train_step, engine, sft_loss, batch, []), engine.train_mode),
        (
            "log_prob_pass",
            partial(engine.infer_batch, {**batch, "calculate_entropy": True}),
            engine.eval_mode,
        ),
    ):
        with mode():
            for _ in range(2):
                run()
            torch.cuda.synchronize()
            t = time.perf_counter()
            run()
            torch.cuda.synchronize()
            plain_wall = time.perf_counter() - t
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run()
                torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with (
                path.open("rb") as src,
                gzip.open(args.out.with_suffix(f".{name}.trace.json.gz"), "wb") as dst,
            ):
                shutil.copyfileobj(src, dst)
        result = {"wall_ms_unprofiled": plain_wall * 1e3, **analyse(trace, top=args.top)}
        sections[name] = result
        print(
            f"== {name}: wall {plain_wall * 1e3:.0f} ms unprofiled, traced {result['wall_ms']:.0f} ms,"
            f" kernels busy {result['kernel_busy_ms']:.0f} ms, idle {result['idle_ms']:.0f} ms"
            f" {json.dumps(result['idle_by_gap_size_ms'])} kernels {json.dumps(result['kernel_ms_by_kind'])}"
        )
        print("   syncing calls:", json.dumps(result["syncing_runtime_calls"]))
        for g in result["largest_gaps"][:10]:
            print(f"   gap {g['ms']:.2f} ms at {g['at_ms']:.1f}: {', '.join(g['host_ops'][:5])}")
    write_record(
        args.out,
        benchmark="gpu_idle_gpu",
        config=vars(args) | {"out": str(args.out)},
        numbers={"sections": sections},
    )


if __name__ == "__main__":
    main()
