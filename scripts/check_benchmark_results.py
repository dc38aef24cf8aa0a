#!/usr/bin/env python3
"""Check that docs/benchmarks.md names every file under benchmarks/results/.

    python scripts/check_benchmark_results.py

A results file nobody cites is a number nobody can trace to a claim, or a claim's record that the doc no
longer points to; either the doc names it or it is deleted (git keeps it). A file counts as named when its
path relative to benchmarks/results/ appears in the doc as a whole path (with or without a leading
``results/`` or ``benchmarks/results/``), not as part of a longer file name, or when a folder above it is named
with its trailing slash (``gpu_suite/h200x4/``: a run's logs, junit and records cited as one). Exits 1 listing
the files the doc does not name.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"


def result_files(results: Path) -> list[str]:
    """Every file under ``results``, as a POSIX path relative to it."""
    return sorted(p.relative_to(results).as_posix() for p in results.rglob("*") if p.is_file())


def is_named(name: str, doc: str) -> bool:
    """Whether ``name`` appears in ``doc`` with no file-name character glued to either end."""
    return re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w-]|\.\w)", doc) is not None


def unnamed(*, results: Path = RESULTS, doc: Path = DOC) -> list[str]:
    """The results files that the doc does not name."""
    text = doc.read_text(encoding="utf-8")
    return [name for name in result_files(results) if not (is_named(name, text) or _folder_named(name, text))]


def _folder_named(name: str, doc: str) -> bool:
    parts = name.split("/")[:-1]
    folders = ["/".join(parts[: i + 1]) + "/" for i in range(len(parts))]
    return any(re.search(rf"(?<![\w.-]){re.escape(f)}(?![\w.-])", doc) for f in folders)


def main() -> int:
    missing = unnamed()
    if not missing:
        return 0
    print(
        f"{len(missing)} file(s) under {RESULTS.relative_to(ROOT)}/ not named by {DOC.relative_to(ROOT)}"
        " (name each next to its figures, or git rm it):",
        file=sys.stderr,
    )
    for name in missing:
        print(f"  {name}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
