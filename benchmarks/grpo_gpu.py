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


# data parallel 2 under torchrun: the micro-batch per GPU of the README's DP-2 command (128 / DP does not divide)
DP2 = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64"]


def run_variant(*, name: str, args: argparse.Namespace, workdir: Path) -> dict:
    """``resident``, ``offload`` (one GPU) or ``dp2`` (two GPUs, torchrun, no offload)."""
    out = workdir / name
    launch = [sys.executable, "-m", "verl_engine"]
    if name == "dp2":
        launch = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "verl_engine",
        ]
    model = (
        []
        if args.cli_defaults
        else [
            "--hidden-size",
            str(args.hidden_size),
            "--layers",
            str(args.layers),
            "--warmup-lr",
            str(args.warmup_lr),
        ]
    )
    cmd = [
        *launch, "grpo", "--out", str(out), "--device", "cuda", *model,
        "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps),
        "--no-progress", "--no-plot", *(["--offload"] if name == "offload" else []),
        "trainer.test_freq=10", "trainer.save_freq=0", *(DP2 if name == "dp2" else []),
        *([] if args.cli_defaults else [f"actor_rollout_ref.actor.optim.lr={args.lr}"]),
    ]  # fmt: skip
    offload = name == "offload"
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{name} failed (offload={offload}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
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
    parser.add_argument(
        "--variants", default="resident,offload", help="comma list of resident, offload (1 GPU), dp2 (2 GPUs)"
    )
    parser.add_argument(
        "--cli-defaults",
        action="store_true",
        help="the grpo command's own model and learning rates (the README's CPU run, on GPUs); ignores"
        " --hidden-size/--layers/--warmup-lr/--lr",
    )
    args = parser.parse_args()
    names = args.variants.split(",")
    unknown = set(names) - {"resident", "offload", "dp2"}
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; choose from resident, offload, dp2")
    with tempfile.TemporaryDirectory() as tmp:
        variants = {name: run_variant(name=name, args=args, workdir=Path(tmp)) for name in names}
    props = torch.cuda.get_device_properties(0)
    hidden, layers = (128, 2) if args.cli_defaults else (args.hidden_size, args.layers)  # grpo's defaults
    params = 12 * hidden**2 * layers  # attention (GQA) + MLP (4x), roughly
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
