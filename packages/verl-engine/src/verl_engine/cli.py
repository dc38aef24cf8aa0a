"""``verl-engine`` command line.

    verl-engine train [--steps N] [--preset tiny|small|base|1b] [--micro-batch-size N]
                      [--global-batch-size N] [--seq-len N] [--lr X] [--output-dir DIR]
                      [--device auto|cpu|cuda] [--config FILE] [key=value ...]

With no arguments it trains the built-in tiny Qwen2-architecture model on generated arithmetic
problems (nothing is downloaded). Under torchrun every process joins one data-parallel group:
``torchrun --nproc-per-node 2 -m verl_engine train``. Flags are shorthands for config keys; any key
can be set with ``key=value`` (e.g. ``megatron.use_distributed_optimizer=false``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from verl_config import ConfigError, SFTConfig, load_config

__all__ = ["main", "parse_train_args"]

_FLAG_TO_KEY = {
    "steps": "trainer.total_training_steps",
    "preset": "model.preset",
    "micro_batch_size": "data.micro_batch_size_per_gpu",
    "global_batch_size": "data.train_batch_size",
    "seq_len": "data.max_length",
    "lr": "optim.lr",
    "output_dir": "trainer.default_local_dir",
    "device": "trainer.device",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-engine", description="Megatron-core training engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="SFT on the built-in arithmetic data (or as configured)")
    train.add_argument("--steps", type=int, help="optimizer steps (trainer.total_training_steps)")
    train.add_argument("--preset", help="model size preset: tiny, small, base, 1b (model.preset)")
    train.add_argument("--micro-batch-size", type=int, help="sequences per micro-batch per GPU")
    train.add_argument("--global-batch-size", type=int, help="sequences per optimizer step, all ranks")
    train.add_argument("--seq-len", type=int, help="tokens per sequence (data.max_length)")
    train.add_argument("--lr", type=float, help="peak learning rate (optim.lr)")
    train.add_argument("--output-dir", help="where metrics.jsonl and summary.json go")
    train.add_argument("--device", choices=("auto", "cpu", "cuda"), help="cpu runs the labelled debug mode")
    train.add_argument("--config", help="YAML file merged over the defaults")
    train.add_argument(
        "--no-progress", action="store_true", help="print a line per step instead of a progress bar"
    )
    train.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides (OmegaConf dotlist)"
    )
    grpo = sub.add_parser(
        "grpo",
        help="GRPO end to end on the embedded arithmetic task: warm start, rollout, reward, KL, update",
        description="Any verl ppo_trainer key can be given as key=value (e.g. actor_rollout_ref.rollout.n=8,"
        " algorithm.use_kl_in_reward=true, trainer.save_freq=5).",
    )
    grpo.add_argument("--out", required=True, help="run directory: metrics.jsonl, sft/, checkpoints/")
    grpo.add_argument("--steps", type=int, help="GRPO steps (trainer.total_training_steps)")
    grpo.add_argument("--warmup-steps", type=int, default=40, help="supervised warm-start steps (default 40)")
    grpo.add_argument("--seed", type=int, default=0, help="run seed: model init, problems, sampling")
    grpo.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    grpo.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    grpo.add_argument("overrides", nargs="*", metavar="key=value", help="verl ppo_trainer overrides")
    return parser


def run_grpo_command(args: argparse.Namespace) -> int:
    """``verl-engine grpo``: prints the held-out accuracy per evaluation and where the metrics are."""
    from verl_engine.grpo_run import GRPORun, run_grpo

    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"trainer.total_training_steps={args.steps}")
    result = run_grpo(
        GRPORun(
            out_dir=args.out,
            overrides=overrides,
            warmup_steps=args.warmup_steps,
            seed=args.seed,
            resume=args.resume,
            device=args.device,
        )
    )
    for step, accuracy in sorted(result["eval"].items()):
        print(f"held-out accuracy after step {step}: {accuracy:.3f}")
    print(f"metrics: {Path(args.out) / 'metrics.jsonl'}")
    return 0


def parse_train_args(argv: list[str]) -> tuple[SFTConfig, argparse.Namespace]:
    """Parse ``train`` arguments into a validated SFTConfig (flags first, then key=value overrides)."""
    args = _parser().parse_args(argv)
    overrides = [
        f"{key}={getattr(args, flag)}"
        for flag, key in _FLAG_TO_KEY.items()
        if getattr(args, flag) is not None
    ]
    if args.no_progress:
        overrides.append("trainer.progress_bar=false")
    overrides += args.overrides
    return load_config(SFTConfig, yaml_path=args.config, overrides=overrides), args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["grpo"]:
        import warnings

        for category in (UserWarning, FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category, module=r"megatron(\.|$)")
        args = _parser().parse_args(argv)
        try:
            return run_grpo_command(args)
        except (ConfigError, FileNotFoundError) as err:
            print(f"verl-engine grpo: {err}", file=sys.stderr)
            return 2
    try:
        cfg, _ = parse_train_args(argv)
    except (ConfigError, FileNotFoundError) as err:
        print(f"verl-engine: config error: {err}", file=sys.stderr)
        return 2
    import warnings

    # megatron-core's import-time notices (apex / TE not installed, deprecations) are noise here.
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"megatron(\.|$)")
    from verl_engine.trainer import train

    try:
        train(cfg)
    except ConfigError as err:
        print(f"verl-engine: config error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
