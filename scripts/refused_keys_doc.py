#!/usr/bin/env python3
"""docs/refused-keys.md, rendered from verl_engine.config_support.RULES (a CPU test checks the committed page).

python scripts/refused_keys_doc.py   # rewrites docs/refused-keys.md
"""

from __future__ import annotations

from pathlib import Path

from verl_engine.config_support import RULES, Kind

PAGE = Path(__file__).resolve().parents[1] / "docs" / "refused-keys.md"

HEADER = """# Refused and non-engine keys (verl 0.9.1)

verl-config accepts every setting verl 0.9.1 accepts. A setting of the actor, ref or critic engine sections that
verl-engine does not implement is refused when an engine is built (`rl_engine_from_config` and the CLI, through
`verl_engine.refusals.check_supported`), before any model is built: the error names the key, its value and what is
supported. Keys that verl's trainer, worker or rollout reads (not a training engine) are listed after.

Generated from `verl_engine.config_support.RULES` by `scripts/refused_keys_doc.py`; a test walks every key of the
schema and checks it is honoured (a test shows its effect), refused, or listed here as not the engine's.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _keys(rule: object) -> str:
    return "<br>".join(f"`{k}`" for k in rule.keys)  # type: ignore[attr-defined]


def _sections(rule: object) -> str:
    return "<br>".join(f"`{s}`" for s in rule.sections)  # type: ignore[attr-defined]


def render() -> str:
    """The page's text."""
    refused = [r for r in RULES if r.kind is Kind.REFUSED]
    not_engine = [r for r in RULES if r.kind is Kind.NOT_ENGINE]
    lines = [
        HEADER,
        "## Refused at build",
        "",
        "| key | sections | supported | why / what to do |",
        "|---|---|---|---|",
    ]
    lines += [f"| {_keys(r)} | {_sections(r)} | {_cell(r.supported)} | {_cell(r.reason)} |" for r in refused]
    lines += ["", "## Not an engine's keys", "", "| key | sections | who reads it |", "|---|---|---|"]
    lines += [f"| {_keys(r)} | {_sections(r)} | {_cell(r.reason)} |" for r in not_engine]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    PAGE.write_text(render())
    print(f"wrote {PAGE}")
