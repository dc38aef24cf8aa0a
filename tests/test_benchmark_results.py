"""scripts/check_benchmark_results.py: docs/benchmarks.md names every file under benchmarks/results/."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import check_benchmark_results as cbr  # noqa: E402


def test_every_results_file_is_named_by_the_doc() -> None:
    assert cbr.main() == 0, f"not named by docs/benchmarks.md: {cbr.unnamed()}"


def test_a_name_counts_only_as_a_whole_file_name(tmp_path: Path) -> None:
    results = tmp_path / "results"
    (results / "logs").mkdir(parents=True)
    for name in ("run.json", "run_repeat.json", "logs/a.log", "b.txt"):
        (results / name).write_text("{}")
    doc = tmp_path / "benchmarks.md"
    doc.write_text("Raw: `benchmarks/results/run_repeat.json`, results/logs/a.log. The b.txt.gz archive.\n")
    assert cbr.unnamed(results=results, doc=doc) == ["b.txt", "run.json"]
