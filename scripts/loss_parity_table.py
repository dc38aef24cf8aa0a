#!/usr/bin/env python3
"""The policy-loss parity table of docs/engine.md, from the JSON the verl-reference test writes.

VERL_LOSS_PARITY_OUT=benchmarks/results/verl_loss_parity.json nox -s "tests(0.19.2)" -- -m verl_reference
python scripts/loss_parity_table.py benchmarks/results/verl_loss_parity.json   # prints the table
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def fmt(value: float) -> str:
    return "0" if value == 0 else f"{value:.1e}"


def cell(worst: dict, layout: str) -> str:
    """``loss / grad`` of one layout; n/a where the test does not compare it (None: clip_cov and kl_cov select
    tokens from each micro-batch's statistics, by verl's definition, so only the whole batch matches verl's)."""
    loss, grad = worst[f"{layout}_loss"], worst[f"{layout}_grad"]
    return "n/a" if loss is None else f"{fmt(loss)} / {fmt(grad)}"


def table(data: dict) -> str:
    rows = [
        "| loss | whole batch: loss / grad | 3 micro-batches: loss / grad | 2 DP ranks: loss / grad | metrics (abs) |",
        "|---|---|---|---|---|",
    ]
    for mode, w in data["losses"].items():
        cells = [cell(w, k) for k in ("whole", "micro", "dp2")]
        rows.append(f"| `{mode}` | " + " | ".join(cells) + f" | {fmt(w['metrics'])} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(json.loads(Path(sys.argv[1]).read_text())))
