"""The PNG of a GRPO run: reward and held-out accuracy per step, and the KL to the reference.

Needs matplotlib (``pip install 'verl-engine[grpo]'``); it is imported here only, so the engine does not
depend on it. Rendering uses the non-interactive Agg backend (no display on a training node).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["plot_grpo_metrics", "plot_grpo_seeds", "require_matplotlib"]


def _records(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def require_matplotlib() -> None:
    """Fail now, with the install line, when matplotlib is missing (callers check before a long run)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(
            "the GRPO plot needs matplotlib: pip install 'verl-engine[grpo]' (or pass --no-plot)"
        ) from None


def _figure():  # type: ignore[no-untyped-def]
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(2, 1))
    top.set_ylabel("reward / accuracy")
    top.set_ylim(-0.02, 1.02)
    top.grid(alpha=0.3)
    bottom.set_ylabel("KL(actor || ref)")
    bottom.set_xlabel("GRPO step")
    bottom.grid(alpha=0.3)
    return plt, fig, top, bottom


def plot_grpo_metrics(metrics_path: str | Path, png_path: str | Path) -> Path:
    """One run's ``metrics.jsonl`` as a PNG: train reward, held-out accuracy (the step-0 record is the warm
    start's, with no training metrics), KL."""
    records = _records(metrics_path)
    plt, fig, top, bottom = _figure()
    evals = [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    records = [r for r in records if "reward_mean" in r]
    steps = [r["step"] for r in records]
    top.plot(
        steps,
        [r["reward_mean"] for r in records],
        color="tab:blue",
        alpha=0.6,
        label="train reward (mean of n samples)",
    )
    if evals:
        top.plot(*zip(*evals, strict=True), "o-", color="tab:red", label="held-out accuracy (greedy)")
    top.legend(loc="lower right")
    if any("kl" in r for r in records):
        bottom.plot(steps, [r.get("kl", float("nan")) for r in records], color="tab:green")
    fig.tight_layout()
    out = Path(png_path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_grpo_seeds(runs: Mapping[int, Sequence[Mapping]], png_path: str | Path, *, title: str = "") -> Path:
    """Several seeds' records (``{seed: records}``, records with ``step``, ``reward_mean``, ``kl`` and, where
    evaluated, ``eval_accuracy``; a record of step 0 may carry the warm start's accuracy) on one PNG."""
    plt, fig, top, bottom = _figure()
    colors = ("tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange")
    for i, (seed, records) in enumerate(sorted(runs.items())):
        color = colors[i % len(colors)]
        train = [r for r in records if "reward_mean" in r]
        top.plot([r["step"] for r in train], [r["reward_mean"] for r in train], color=color, alpha=0.25)
        evals = [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
        top.plot(*zip(*evals, strict=True), "o-", color=color, label=f"seed {seed}: held-out accuracy")
        kl = [r for r in train if "kl" in r]
        bottom.plot([r["step"] for r in kl], [r["kl"] for r in kl], color=color)
    top.plot([], [], color="grey", alpha=0.4, label="train reward (faint)")
    top.legend(loc="lower right")
    if title:
        top.set_title(title)
    fig.tight_layout()
    out = Path(png_path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
