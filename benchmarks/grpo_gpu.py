"""``verl-engine grpo`` on one GPU with a larger model: seconds and GPU memory per phase, with and without offload.

    cd benchmarks && python3 grpo_gpu.py --out results/grpo_gpu_h100.json --hidden-size 2048 --layers 16

Two runs of the same command (the embedded arithmetic task, megatron-core actor and reference in bf16, the
transformers rollout in bf16 in the same process: colocated), one with ``--offload`` (verl's
``actor.megatron.{param,grad,optimizer}_offload`` and ``ref.megatron.param_offload``: the trainer's state
leaves the GPU while the rollout generates, the rollout's weights leave it while the trainer works). Per
phase (sync, generate, old_log_prob, ref_log_prob, train) the JSON has the mean seconds over the steps after
the first and the GPU memory: the peak allocated during the phase and the allocated at its end (max over
steps). Also the held-out accuracy after the warm start and after the last step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _record import write_record

PHASES = ("sync", "generate", "old_log_prob", "ref_log_prob", "train")


def run_variant(*, offload: bool, args: argparse.Namespace, workdir: Path) -> dict:
    out = workdir / ("offload" if offload else "resident")
    cmd = [
        sys.executable, "-m", "verl_engine", "grpo", "--out", str(out), "--device", "cuda",
        "--hidden-size", str(args.hidden_size), "--layers", str(args.layers),
        "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps), "--warmup-lr", str(args.warmup_lr),
        "--no-progress", "--no-plot", *(["--offload"] if offload else []),
        "trainer.test_freq=10", "trainer.save_freq=0", f"actor_rollout_ref.actor.optim.lr={args.lr}",
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(
            f"{'offload' if offload else 'resident'} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval_accuracy"] for r in records if "eval_accuracy" in r}
    records = [r for r in records if "reward_mean" in r]  # the training steps (step 0: the warm start's eval)
    timed = records[1:] or records
    phases = {}
    for phase in PHASES:
        phases[phase] = {
            "seconds_mean": statistics.mean(r["seconds"][phase] for r in timed),
            "peak_gib_max": max(r["memory_gib"][phase]["peak"] for r in records),
            "end_gib_max": max(r["memory_gib"][phase]["end"] for r in records),
        }
    return {
        "command": " ".join(cmd[1:]),
        "wall_s": wall,
        "phases": phases,
        "step_seconds_mean": statistics.mean(r["seconds"]["step"] for r in timed),
        "peak_memory_gib": max(r["peak_memory_gib"] for r in records),
        "eval": evals,
        "reward_first_last": [records[0]["reward_mean"], records[-1]["reward_mean"]],
        "records": records,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup-steps", type=int, default=300)
    parser.add_argument("--warmup-lr", type=float, default=1e-4)
    parser.add_argument("--lr", type=float, default=2e-5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        variants = {
            name: run_variant(offload=name == "offload", args=args, workdir=Path(tmp))
            for name in ("resident", "offload")
        }
    props = torch.cuda.get_device_properties(0)
    params = 12 * args.hidden_size**2 * args.layers  # attention (GQA) + MLP (4x), roughly
    result = write_record(
        args.out,
        benchmark="grpo_gpu",
        device={"name": props.name, "memory_gib": props.total_memory / 2**30},
        config={**vars(args), "approx_params": params},
        extra_versions=("transformers",),
        numbers={
            "summary": {
                name: {
                    "phases": v["phases"],
                    "step_seconds_mean": v["step_seconds_mean"],
                    "peak_memory_gib": v["peak_memory_gib"],
                    "eval": v["eval"],
                    "wall_s": v["wall_s"],
                }
                for name, v in variants.items()
            },
            "variants": variants,
        },
    )
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
