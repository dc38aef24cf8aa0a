"""What drives the engine: the ``verl-engine`` command line (SFT ``train``, ``grpo``), the SFT loop, the GRPO
run on the embedded arithmetic task, the transformers rollout, Ray workers and the demo data.

Imports run from here into the engine core only, never back: the core is usable without anything here.
Names load on first use (PEP 562).
"""

from typing import Any

_LAZY: dict[str, str] = {
    "GRPORun": "verl_engine.apps.grpo_run",
    "HFRollout": "verl_engine.apps.rollout",
    "InProcessWorkers": "verl_engine.apps.grpo_workers",
    "RayWorkers": "verl_engine.apps.grpo_workers",
    "RolloutEngine": "verl_engine.apps.rollout",
    "RunSummary": "verl_engine.apps.sft",
    "SamplingParams": "verl_engine.apps.rollout",
    "grpo_outcome_advantage": "verl_engine.apps.grpo",
    "resolve_device": "verl_engine.apps.sft",
    "rollout_batch": "verl_engine.apps.grpo",
    "run_grpo": "verl_engine.apps.grpo_run",
    "train": "verl_engine.apps.sft",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'verl_engine.apps' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = sorted(_LAZY)
