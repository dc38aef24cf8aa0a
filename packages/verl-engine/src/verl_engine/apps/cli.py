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
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from verl_config import ConfigError, SFTConfig, load_config
from verl_engine.apps.interrupt import RunInterrupted
from verl_engine.apps.quiet import quiet_third_party_notices
from verl_engine.apps.run_dir import prepare_run_dir

if TYPE_CHECKING:
    from verl_engine.apps.ray_workers import RayWorkerGroup

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
    train.add_argument("--overwrite", action="store_true", help="replace the run already in --output-dir")
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
        description="GRPO on the embedded arithmetic task (nothing to download): a supervised warm start, then per"
        " step weight sync into the transformers rollout, n samples per prompt, exact-match reward, group-normalised"
        " advantages, reference KL, PPO update. Any verl ppo_trainer key can be given as key=value (e.g."
        " actor_rollout_ref.rollout.n=8, algorithm.use_kl_in_reward=true, trainer.save_freq=5,"
        " actor_rollout_ref.model.path=<Hugging Face directory>). Under torchrun every process is a rank:"
        " torchrun --nproc-per-node 2 -m verl_engine grpo --out run actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    )
    grpo.add_argument(
        "--out", required=True, help="run directory: metrics.jsonl, grpo.png, sft/, checkpoints/"
    )
    grpo.add_argument("--steps", type=int, help="GRPO steps (trainer.total_training_steps, default 100)")
    grpo.add_argument("--warmup-steps", type=int, help="supervised warm-start steps (default 1000; 0: none)")
    grpo.add_argument(
        "--warmup-error-rate",
        type=float,
        help="fraction of the warm-start demonstrator's answers that are off by one (default 0.7)",
    )
    grpo.add_argument(
        "--init-from",
        metavar="DIR",
        help="start from this Hugging Face directory (e.g. an earlier run's sft/) instead of a warm start:"
        " actor_rollout_ref.model.path=DIR, --warmup-steps 0 unless given",
    )
    grpo.add_argument("--warmup-lr", type=float, help="warm-start learning rate (default 1e-3)")
    grpo.add_argument("--seed", type=int, default=0, help="run seed: model init, problems, sampling")
    grpo.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    grpo.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run already in --out (its metrics, plot, sft/, checkpoints/)",
    )
    grpo.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the engines and the rollout run (default cpu)",
    )
    grpo.add_argument("--hidden-size", type=int, help="embedded model width (default 128)")
    grpo.add_argument("--layers", type=int, help="embedded model depth (default 2)")
    grpo.add_argument(
        "--offload",
        action="store_true",
        help="colocated: actor params/grads/optimizer and ref params off the GPU while the rollout runs"
        " (sets verl's actor/ref megatron.*_offload keys)",
    )
    grpo.add_argument(
        "--ray",
        action="store_true",
        help="run the engines in a Ray worker group (trainer.nnodes x trainer.n_gpus_per_node ranks)",
    )
    grpo.add_argument("--no-progress", action="store_true", help="no progress bar")
    grpo.add_argument("--no-plot", action="store_true", help="do not write <out>/grpo.png (needs matplotlib)")
    grpo.add_argument("overrides", nargs="*", metavar="key=value", help="verl ppo_trainer overrides")
    parser.set_defaults(commands={"train": train, "grpo": grpo})
    return parser


def _parse(argv: list[str]) -> argparse.Namespace:
    """The command's own parser when the command is known, so a misspelt flag shows that command's usage."""
    parser = _parser()
    commands = parser.get_default("commands")
    if argv[:1] and argv[0] in commands:
        args = commands[argv[0]].parse_args(argv[1:])
        args.command = argv[0]
        return args
    return parser.parse_args(argv)


_OFFLOAD_KEYS = (
    "actor_rollout_ref.actor.megatron.param_offload=true",
    "actor_rollout_ref.actor.megatron.grad_offload=true",
    "actor_rollout_ref.actor.megatron.optimizer_offload=true",
    "actor_rollout_ref.ref.megatron.param_offload=true",
)


def run_grpo_command(args: argparse.Namespace) -> int:
    """``verl-engine grpo``: prints the held-out accuracy per evaluation and where the metrics are."""
    from verl_engine.apps.grpo_run import GRPORun, RayWorkers, run_grpo

    prepare_run_dir(args.out, flag="--out", resume=args.resume, overwrite=args.overwrite, can_resume=True)
    overrides = [*(_OFFLOAD_KEYS if args.offload else ()), *args.overrides]
    if args.init_from is not None:
        overrides.append(f"actor_rollout_ref.model.path={args.init_from}")
        if args.warmup_steps is None:
            args.warmup_steps = 0
    if args.steps is not None:
        overrides.append(f"trainer.total_training_steps={args.steps}")
    optional = {
        "warmup_steps": args.warmup_steps,
        "warmup_error_rate": args.warmup_error_rate,
        "warmup_lr": args.warmup_lr,
        "hidden_size": args.hidden_size,
        "layers": args.layers,
    }
    run = GRPORun(
        out_dir=args.out,
        overrides=overrides,
        seed=args.seed,
        resume=args.resume,
        device=args.device,
        progress=not args.no_progress,
        plot=not args.no_plot,
        **{k: v for k, v in optional.items() if v is not None},
    )
    if run.plot:
        from verl_engine.apps.grpo_plot import require_matplotlib

        try:
            require_matplotlib()
        except ImportError as err:
            raise ConfigError(str(err)) from None
    workers, group = None, None
    if args.ray:
        group = _ray_group(overrides, device=args.device)
        workers = RayWorkers(group, device=args.device)
    try:
        result = run_grpo(run, workers=workers)
    finally:
        if group is not None:
            group.shutdown()
    if os.environ.get("RANK", "0") != "0":  # under torchrun every rank ran the loop; rank 0 reports
        return 0
    for step, accuracy in sorted(result["eval"].items()):
        print(f"held-out accuracy after step {step}: {accuracy:.3f}")
    print(f"metrics: {Path(args.out) / 'metrics.jsonl'}")
    if run.plot:
        print(f"plot: {Path(args.out) / 'grpo.png'}")
    return 0


def _ray_group(overrides: list[str], *, device: str) -> RayWorkerGroup:
    """A RayWorkerGroup of trainer.nnodes x trainer.n_gpus_per_node ranks (a local Ray if none is running)."""
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray: pip install 'verl-engine[ray]'") from None
    from verl_engine.apps.grpo_run import _DEFAULTS
    from verl_engine.apps.ray_workers import RayWorkerGroup

    cfg = load_config(overrides=[*_DEFAULTS, *overrides])
    world = int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)
    if not ray.is_initialized():
        ray.init(num_cpus=max(world, 1), include_dashboard=False, log_to_driver=False)
    return RayWorkerGroup(world_size=world, gpus_per_rank=1 if device == "cuda" else 0)


def parse_train_args(argv: list[str]) -> tuple[SFTConfig, argparse.Namespace]:
    """Parse ``train`` arguments into a validated SFTConfig (flags first, then key=value overrides)."""
    args = _parse(argv)
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
    quiet_third_party_notices()  # before megatron-core is imported: its notices come at import time
    if argv[:1] == ["grpo"]:
        args = _parse(argv)
        try:
            return run_grpo_command(args)
        except (ConfigError, FileNotFoundError) as err:
            print(f"verl-engine grpo: {err}", file=sys.stderr)
            return 2
        except RunInterrupted as stopped:
            if os.environ.get("RANK", "0") == "0":
                how = (
                    f"continue with: verl-engine grpo --out {args.out} --resume"
                    if stopped.checkpoint is not None
                    else f"nothing to resume; start again with: verl-engine grpo --out {args.out}"
                )
                print(f"verl-engine grpo: {stopped}; {how}", file=sys.stderr)
            return stopped.exit_code
    try:
        cfg, args = parse_train_args(argv)
        prepare_run_dir(
            cfg.trainer.default_local_dir,
            flag="--output-dir",
            resume=False,
            overwrite=args.overwrite,
            can_resume=False,
        )
    except (ConfigError, FileNotFoundError) as err:
        print(f"verl-engine: config error: {err}", file=sys.stderr)
        return 2
    from verl_engine.apps.sft import train

    try:
        train(cfg)
    except ConfigError as err:
        print(f"verl-engine: config error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
