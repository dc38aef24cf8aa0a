#!/usr/bin/env python3
"""Do two layouts' loss curves agree within bf16 noise? Three ``scaling_gpu.py --vary-batch`` records.

    python3 benchmarks/loss_curves.py --reference results/curve_ddp_h200x4.json \
        --noise results/curve_ddp_fp32reduce_h200x4.json --run results/curve_mfsdp_h200x4.json \
        --out results/curve_mfsdp_vs_ddp_h200x4.json

Issue 36 asks Megatron-FSDP's 50-step loss curve to agree with DDP's "within bf16 noise". That noise is measured,
not assumed: ``--noise`` is the reference layout again with only the precision of its gradient reduction changed
(bf16 against fp32), which perturbs every step by bf16 rounding and nothing else. Over many steps such
perturbations grow (the runs' weights drift apart), so the band is the largest relative difference of the noise
run from the reference over the curve, and the run agrees when its own largest relative difference stays within
``--factor`` (default 2) times that band. The records must be the same work (shape, sequences, micro-batches,
recompute, LM head, a new batch every step), the same number of steps, device and commit; else this refuses by
name.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from _record import SAME_WORK as SAME_SCALING_WORK
from _record import refuse_other_work, write_record

SAME_WORK = (*SAME_SCALING_WORK, "batch")


def _relative(losses: list[float], ref: list[float]) -> list[float]:
    return [abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=True)]


def _check(name: str, rec: dict[str, Any], ref: dict[str, Any]) -> None:
    if rec["config"].get("batch", "").startswith("the same"):
        raise SystemExit(f"{name} ran the same batch every step; a curve needs scaling_gpu.py --vary-batch")
    refuse_other_work(name, rec, ref, keys=SAME_WORK)
    if len(rec["losses"]) != len(ref["losses"]):
        raise SystemExit(f"{name} has {len(rec['losses'])} steps, the reference {len(ref['losses'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reference", type=Path, required=True, help="the reference layout's curve")
    parser.add_argument(
        "--noise", type=Path, required=True, help="the reference layout, other reduce precision"
    )
    parser.add_argument("--run", type=Path, required=True, help="the layout under test")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--factor", type=float, default=2.0, help="how many noise bands the run may use")
    args = parser.parse_args(argv)
    ref, noise, run = (json.loads(p.read_text()) for p in (args.reference, args.noise, args.run))
    _check("--noise", noise, ref)
    _check("--run", run, ref)
    band = _relative(noise["losses"], ref["losses"])
    diff = _relative(run["losses"], ref["losses"])
    agree = max(diff) <= args.factor * max(band)
    write_record(
        args.out,
        benchmark="loss_curves",
        device=ref["device"],
        config={
            **{key: ref["config"].get(key) for key in SAME_WORK},
            "reference": str(args.reference),
            "noise": str(args.noise),
            "run": str(args.run),
            "rule": f"max relative difference of the run <= {args.factor} x that of the noise run",
        },
        numbers={
            "steps": len(ref["losses"]),
            "reference_losses": ref["losses"],
            "noise_losses": noise["losses"],
            "run_losses": run["losses"],
            "noise_band": max(band),
            "max_relative_difference": max(diff),
            "mean_relative_difference": sum(diff) / len(diff),
            "agree_within_noise": agree,
            "measured_commit": ref["commit"],
        },
    )
    print(
        f"{len(diff)} steps: run vs reference max {max(diff):.2e}, noise band {max(band):.2e}: "
        f"{'agree' if agree else 'DISAGREE'} (rule: <= {args.factor} x band)"
    )
    return 0 if agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
