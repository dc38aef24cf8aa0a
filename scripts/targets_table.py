#!/usr/bin/env python3
"""The table of docs/benchmarks.md that says where each issue-36 target stands, from benchmarks/results/targets.json.

The benchmark scripts write targets.json (never by hand); this renders it, and a test checks that the page holds
exactly this rendering, so the summary cannot drift from the records.

    python scripts/targets_table.py            # prints the table
    python scripts/targets_table.py --write    # replaces the table in docs/benchmarks.md (after a run)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ROOT / "benchmarks" / "results" / "targets.json"
DOC = ROOT / "docs" / "benchmarks.md"
_HEADER = "| target | value | goal | met | GPU | commit | record |"
_BOUND = re.compile(r"^\s*(>=|<=)\s*([0-9.]+)")


def met(value: float, goal: str, *, ideal_bound: float | None = None) -> str:
    """``yes`` / ``no`` against the goal's leading ``>= x`` or ``<= x``; ``-`` for a goal that is a measurement.

    A goal that also names the ideal bound (dynamic CP: ">= 1.3x ... and within 10% of the ideal bound (95% of it
    if the bound < 1.3x)") is met only when both clauses hold, so a speedup over the first number alone never
    reads as met. Without the measured bound that goal cannot be judged: ``?``.
    """
    bound = _BOUND.match(goal)
    if bound is None:
        return "-"
    op, limit = bound.group(1), float(bound.group(2))
    ok = value >= limit if op == ">=" else value <= limit
    if "ideal bound" in goal:
        if ideal_bound is None:
            return "?"
        ok = value >= 0.95 * ideal_bound if ideal_bound < limit else ok and value >= 0.9 * ideal_bound
    return "yes" if ok else "no"


def table(targets: dict) -> str:
    rows = [_HEADER, "|---|---|---|---|---|---|---|"]
    ideal = targets.get("dyncp_ideal_bound_speedup", {}).get("value")
    for key, t in sorted(targets.items()):
        record = Path(t["source"]).name
        rows.append(
            f"| `{key}` | {t['value']:.3f} | {t['goal']} | {met(t['value'], t['goal'], ideal_bound=ideal)} | {t['gpu']} |"
            f" {t['commit']} | `{record}` |"
        )
    return "\n".join(rows)


def write(doc: Path = DOC, targets: Path = TARGETS) -> None:
    """Replace the table in ``doc`` (from its header row to the first line that is not a table row)."""
    lines = doc.read_text().split("\n")
    if _HEADER not in lines:
        raise SystemExit(f"{doc}: no targets table (its header row {_HEADER!r}) to replace")
    start = lines.index(_HEADER)
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    lines[start:end] = table(json.loads(targets.read_text())).split("\n")
    doc.write_text("\n".join(lines))


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        write()
    else:
        print(table(json.loads(TARGETS.read_text())))
