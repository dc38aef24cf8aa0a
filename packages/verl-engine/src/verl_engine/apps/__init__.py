"""What drives the engine: the ``verl-engine`` command line (SFT ``train``, ``grpo``), the SFT loop, the GRPO
run on the embedded arithmetic task, the transformers rollout, Ray workers and the demo data.

Imports run from here into the engine core only, never back: the core is usable without anything here.
Names load on first use (PEP 562).
"""

from verl_mcore_utils.lazy import lazy_attributes

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


__getattr__, __dir__ = lazy_attributes(module=__name__, lazy=_LAZY)

__all__ = sorted(_LAZY)
