"""Per-rank entry for the end-to-end training tests (picklable: module level)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any


def run_train(rank: int, world_size: int, overrides: list[str]) -> dict[str, Any]:
    from verl_config import SFTConfig, load_config
    from verl_engine.apps.sft import train

    cfg = load_config(SFTConfig, overrides=overrides)
    summary = train(cfg)
    out = asdict(summary)
    if rank == 0:
        out["losses"] = [
            json.loads(line)["loss"] for line in Path(summary.metrics_path).read_text().splitlines()
        ]
    return out
