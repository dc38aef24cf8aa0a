"""Where the RL engine's time goes on one GPU: torch profiler over one SFT step and one log-prob pass.

    cd benchmarks && python3 profile_engine_gpu.py --out results/profile_engine_1.5b_h100.txt

Same model and batch as engine_step_gpu.py (8 sequences of ``--seq`` tokens, from ``_common``). Writes the kernel table
(CUDA time, top 30) and the CPU-side op table, plus GPU busy time vs wall time (a gap means the GPU waits
on the host).
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path

import torch
from _common import SHAPES, build, lengths_for, make_batch, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--fused", action="store_true")
    args = parser.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from verl_engine.losses import sft_loss
    from verl_mcore_utils.parallel import init_parallel

    init_parallel(device="cuda")
    engine, _ = build(args.shape, seq=args.seq, fused=args.fused, sequences=8)
    batch = make_batch(
        lengths_for("fixed", count=8, seq=args.seq, seed=0), vocab=SHAPES[args.shape][5], seed=0
    )
    sections = []
    for name, run, mode in (
        ("sft step", partial(train_step, engine, sft_loss, batch, []), engine.train_mode),
        (
            "log-prob pass",
            partial(engine.infer_batch, {**batch, "calculate_entropy": True}),
            engine.eval_mode,
        ),
    ):
        with mode():
            run()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
                t = time.perf_counter()
                run()
                torch.cuda.synchronize()
                wall = time.perf_counter() - t
        events = prof.key_averages()
        busy = sum(e.self_device_time_total for e in events) / 1e6
        sections.append(f"===== {name}: wall {wall:.3f} s, GPU kernel time {busy:.3f} s")
        sections.append(events.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))
        sections.append(events.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70))
        # the host-side hot spots with the Python lines that issue them (syncs show up as CPU time here)
        by_stack = prof.key_averages(group_by_stack_n=6)
        sections.append(by_stack.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(sections) + "\n")
    print("\n".join(s for s in sections if s.startswith("=====")))


if __name__ == "__main__":
    main()
