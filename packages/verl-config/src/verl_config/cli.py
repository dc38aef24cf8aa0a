"""``verl-config`` command: print or validate a resolved config.

verl-config show [--config FILE] [key=value ...]
verl-config validate [--config FILE] [--world-size N] [key=value ...]
"""

from __future__ import annotations

import argparse
import sys

from verl_config.errors import ConfigError
from verl_config.loader import load_config, to_yaml
from verl_config.schema import SFTConfig

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="verl-config", description=__doc__.splitlines()[0] if __doc__ else None
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("show", "validate"):
        p = sub.add_parser(name)
        p.add_argument("--config", help="YAML file merged over the defaults")
        p.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. optim.lr=1e-4")
        if name == "validate":
            p.add_argument("--world-size", type=int, default=None, help="also check the parallel layout")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(SFTConfig, yaml_path=args.config, overrides=args.overrides)
        if args.command == "validate" and args.world_size is not None:
            cfg.check_world_size(args.world_size)
    except (ConfigError, FileNotFoundError) as err:
        print(f"verl-config: error: {err}", file=sys.stderr)
        return 2
    print(to_yaml(cfg) if args.command == "show" else "config is valid")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
