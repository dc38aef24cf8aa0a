"""The default ``verl-engine grpo`` run on this machine's CPU, three seeds: wall time and held-out accuracy.

    uv run python benchmarks/grpo_cpu_seeds.py --seeds 0 1 2 \\
        --out benchmarks/results/grpo_cpu_seeds.json --png docs/img/grpo_arithmetic.png

Each seed is one ``verl-engine grpo --out <tmp> --seed S --no-progress`` process, run one after another (a
seed's wall time is the whole command: imports, warm start, GRPO steps, evaluations, checkpoints, plot).
The JSON holds the device, versions, the command, every seed's held-out accuracy per evaluation and wall
time, and the summary the README quotes: accuracy after the warm start vs after the last step, with the
seed-to-seed spread of each.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _record import results_path, write_record


def run_seed(seed: int, extra: list[str], workdir: Path) -> dict:
    out = workdir / f"seed{seed}"
    cmd = [
        sys.executable,
        "-m",
        "verl_engine",
        "grpo",
        "--out",
        str(out),
        "--seed",
        str(seed),
        "--no-progress",
        *extra,
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"seed {seed} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # step 0's record is the warm start's evaluation (no training metrics)
    evals = {r["step"]: r["eval_accuracy"] for r in records if "eval_accuracy" in r}
    return {"seed": seed, "wall_s": wall, "eval": evals, "records": records}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default=results_path("grpo_cpu_seeds.json"))
    parser.add_argument("--png", default="docs/img/grpo_arithmetic.png")
    parser.add_argument(
        "extra", nargs="*", help="more verl-engine grpo arguments (default: none = the defaults)"
    )
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            runs.append(run_seed(seed, args.extra, Path(tmp)))
            r = runs[-1]
            print(
                f"seed {seed}: {r['wall_s']:.0f} s, held-out {r['eval'][0]:.3f} -> {r['eval'][max(r['eval'])]:.3f}"
            )
    first = [r["eval"][0] for r in runs]
    final = [r["eval"][max(r["eval"])] for r in runs]
    summary = {
        "held_out_after_warm_start": {
            "per_seed": first,
            "mean": statistics.mean(first),
            "stdev": statistics.pstdev(first),
        },
        "held_out_after_last_step": {
            "per_seed": final,
            "mean": statistics.mean(final),
            "stdev": statistics.pstdev(final),
        },
        "rise_per_seed": [b - a for a, b in zip(first, final, strict=True)],
        "wall_s_per_seed": [r["wall_s"] for r in runs],
    }
    write_record(
        args.out,
        benchmark="grpo_cpu_seeds",
        device={
            "kind": "cpu",
            "processor": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
        },
        config={k: v for k, v in vars(args).items() if k != "out"},
        extra_versions=("transformers",),
        numbers={
            "command": "verl-engine grpo --out <dir> --seed S --no-progress " + " ".join(args.extra),
            "summary": summary,
            "runs": runs,
        },
    )
    from verl_engine.apps.grpo_plot import plot_grpo_seeds

    series = {r["seed"]: r["records"] for r in runs}  # step 0's record carries the warm start's accuracy
    plot_grpo_seeds(
        series,
        args.png,
        title=f"verl-engine grpo (defaults), {len(runs)} seeds, {os.cpu_count()} CPU cores",
    )
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
