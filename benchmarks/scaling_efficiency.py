#!/usr/bin/env python3
"""Data-parallel scaling efficiency from two ``scaling_gpu.py`` records: a one-GPU run and a multi-GPU run.

    python3 benchmarks/scaling_efficiency.py --key dp4_scaling_efficiency \
        --baseline benchmarks/results/scaling_1.5b_dp1_mt16k_recompute_a_h200x1.json \
        --baseline benchmarks/results/scaling_1.5b_dp1_mt16k_recompute_b_h200x1.json \
        --run benchmarks/results/scaling_1.5b_dp4_mt16k_recompute_h200x4.json \
        --out benchmarks/results/scaling_1.5b_dp4_mt16k_recompute_efficiency_h200.json

``scaling_gpu.py --baseline`` computes the same ratio on the machine that ran the multi-GPU layout. This script
exists for a baseline measured on another machine of the same GPU type: a one-process run on a 4-GPU host was
host-bound and noisy at 4096-token micro-batches (issue 36, part 5), so the one-GPU figure is taken where it is
steady. The records must describe the same work per replica (shape, sequence length, sequences per replica,
micro-batch, recompute, LM head) on the same GPU type and commit; anything else is refused by name, because
then the ratio would compare settings, not scaling. Of several baselines the fastest is used (the one-GPU
figure least disturbed by its host), and every baseline's figure is kept in the record.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _record import SAME_WORK, refuse_other_work, update_target, write_record

GOAL = ">= 0.95 (tokens/s per GPU against one GPU)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--baseline", type=Path, action="append", required=True, help="one-GPU record (repeatable)"
    )
    parser.add_argument("--run", type=Path, required=True, help="the multi-GPU record")
    parser.add_argument("--out", type=Path, required=True, help="where the efficiency record goes")
    parser.add_argument("--key", default=None, help="the targets.json key to set (none: only the record)")
    parser.add_argument("--targets", type=Path, default=None, help="the targets file (default: results/)")
    args = parser.parse_args(argv)
    run = json.loads(args.run.read_text())
    bases = [(path, json.loads(path.read_text())) for path in args.baseline]
    for path, base in bases:
        if base.get("gpus") != 1:
            raise SystemExit(f"--baseline {path} ran on {base.get('gpus')} GPUs, not one")
        refuse_other_work(f"--baseline {path}", base, run)
    best_path, best = max(bases, key=lambda item: item[1]["tokens_per_s_per_gpu"])
    efficiency = run["tokens_per_s_per_gpu"] / best["tokens_per_s_per_gpu"]
    record = write_record(
        args.out,
        benchmark="scaling_efficiency",
        device=run["device"],
        config={
            **{key: run["config"].get(key) for key in SAME_WORK},
            "run": str(args.run),
            "baselines": [str(path) for path, _ in bases],
            "method": "tokens/s per GPU of the run over the fastest one-GPU baseline's",
        },
        numbers={
            "gpus": run["gpus"],
            "scaling_efficiency": efficiency,
            "run_tokens_per_s_per_gpu": run["tokens_per_s_per_gpu"],
            "baseline_tokens_per_s_per_gpu": {
                str(path): base["tokens_per_s_per_gpu"] for path, base in bases
            },
            "baseline_used": str(best_path),
            "measured_commit": run["commit"],
        },
    )
    print(
        f"scaling efficiency {efficiency:.4f}: {run['tokens_per_s_per_gpu']:.0f} tokens/s per GPU at "
        f"{run['gpus']} GPUs against {best['tokens_per_s_per_gpu']:.0f} on one ({best_path.name})"
    )
    if args.key:
        # The measured code is the records' commit, not this checkout's.
        record = {**record, "commit": run["commit"]}
        extra = {"targets": args.targets} if args.targets else {}
        update_target(args.key, efficiency, goal=GOAL, source=args.out, record=record, **extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
