"""``verl-config``: show, validate, diff and generate trainer configs.

    verl-config show [--entry ppo_trainer] [--config FILE] [overrides...]
    verl-config validate [--entry ...] [--config FILE] [overrides...]
    verl-config diff --engines fsdp megatron
    verl-config generate [--check] [--dir DIR]

Overrides use verl's syntax: key=value, +key=value, ++key=value, ~key. ``--entry sft`` loads the
``verl-engine train`` schema instead of the PPO trainer. ``show`` needs only valid keys and values
(the keys a run must still set, such as micro-batch sizes, may be null); ``validate`` applies every
rule and reports every error found, one a line. Exit status: 0 ok, 1 stale generated files, 2 invalid
config or usage.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from verl_config.compose import ENTRIES, compose_config, load_config
from verl_config.errors import ConfigError, ConfigValueError, errors_of
from verl_config.generate import GENERATED_DIR, check_generated, engine_differences, write_generated
from verl_config.notes import config_notes
from verl_config.ppo import MODEL_ENGINES
from verl_config.sft import SFTConfig

__all__ = ["main"]


def _load(args: argparse.Namespace) -> object:
    if args.entry != "sft":
        if args.world_size is not None:
            raise ConfigValueError(
                "--world-size",
                "applies to --entry sft only; ppo_trainer takes trainer.nnodes x trainer.n_gpus_per_node",
            )
        return load_config(args.entry, yaml_path=args.config, overrides=args.overrides)
    cfg = load_config(SFTConfig, yaml_path=args.config, overrides=args.overrides)
    if args.world_size is not None:
        cfg.check_world_size(args.world_size)
    return cfg


def _show(args: argparse.Namespace) -> str:
    """The composed config as YAML, interpolations resolved; rules between keys are left to ``validate``.

    A partial config (e.g. without the micro-batch sizes a run must set) is shown as it stands, so the
    defaults can be read before they are completed.
    """
    entry: Any = SFTConfig if args.entry == "sft" else args.entry
    cfg = compose_config(entry, yaml_path=args.config, overrides=args.overrides)
    try:
        return OmegaConf.to_yaml(cfg, resolve=True)
    except OmegaConfBaseException as err:  # an interpolation that does not resolve: show it unresolved
        print(
            f"verl-config: warning: {str(err).splitlines()[0]}; showing interpolations unresolved",
            file=sys.stderr,
        )
        return OmegaConf.to_yaml(cfg)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verl-config", description="Show, validate, diff and generate trainer configs."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("show", "print the composed config as YAML (rules between keys: see validate)"),
        ("validate", "check a config, print notes"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument(
            "--entry",
            default="ppo_trainer",
            choices=[*ENTRIES, "sft"],
            help="entry config (default ppo_trainer)",
        )
        p.add_argument("--config", help="YAML file merged over the defaults")
        p.add_argument("overrides", nargs="*", help="key=value, +key=value, ++key=value or ~key")
        p.add_argument(
            "--world-size", type=int, default=None, help="sft entry only: check the layout for N processes"
        )
    diff = sub.add_parser("diff", help="defaults that differ between two engines")
    diff.add_argument(
        "--engines", nargs=2, default=list(MODEL_ENGINES), choices=MODEL_ENGINES, metavar="ENGINE"
    )
    gen = sub.add_parser("generate", help="write (or --check) the generated reference configs")
    gen.add_argument("--check", action="store_true", help="only report stale files (exit 1 when stale)")
    gen.add_argument(
        "--dir", type=Path, default=GENERATED_DIR, help=f"output folder (default {GENERATED_DIR})"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # `verl-config diff | head`: the reader left; no traceback for that
        try:  # Python's recipe: stdout onto /dev/null, so flushing it at exit raises nothing either
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # a stdout without a file descriptor (captured): nothing to flush
            pass
        return 0


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "diff":
        a, b = args.engines
        for key, (va, vb) in engine_differences().items():
            left, right = (va, vb) if (a, b) == ("fsdp", "megatron") else (vb, va)
            print(f"{key}: {a}={left!r} {b}={right!r}")
        return 0
    if args.command == "generate":
        if args.check:
            stale = check_generated(args.dir)
            for name, diff in stale.items():
                print(f"verl-config: {name} is stale; run `verl-config generate`\n{diff}", file=sys.stderr)
            if not stale:
                print("generated configs are up to date")
            return 1 if stale else 0
        for path in write_generated(args.dir):
            print(f"wrote {path}")
        return 0
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = _show(args) if args.command == "show" else _load(args)
    except FileNotFoundError as err:
        print(f"verl-config: error: {err}", file=sys.stderr)
        return 2
    except ConfigError as err:  # every error found, one a line
        found = errors_of(err)
        for single in found:
            print(f"verl-config: error: {single}", file=sys.stderr)
        if len(found) > 1:
            print(f"verl-config: {len(found)} errors", file=sys.stderr)
        return 2
    for w in caught:
        print(f"verl-config: warning: {w.message}", file=sys.stderr)
    for text in config_notes(cfg):
        print(f"verl-config: note: {text}", file=sys.stderr)
    print(cfg if args.command == "show" else "config is valid")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
