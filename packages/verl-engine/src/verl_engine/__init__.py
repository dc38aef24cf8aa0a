"""verl_engine: a megatron-core training engine for LLM post-training (RL).

Public API:

* The RL engine (verl's engine surface): :class:`RLEngine` (``forward_backward_batch``, ``train_batch``,
  ``infer_batch``, ``train_mode`` / ``eval_mode``, ``optimizer_step``, ``lr_scheduler_step`` ...) built by
  :func:`rl_engine_from_config` from a loaded verl-config ``ppo_trainer`` config (actor / ref / critic) or
  :func:`build_rl_engine` from the sections; :class:`MicroBatching`, :class:`RLBatch`.
* Losses (:mod:`verl_engine.losses`): ``ppo_loss``, ``value_loss``, ``sft_loss``, ``agg_loss``,
  ``kl_penalty``, the policy-loss registry; the learning-rate schedule (:mod:`verl_engine.lr_schedule`);
  vocab-parallel log-probs and entropy (:func:`vocab_parallel_log_probs_and_entropy`).
* RL loop pieces: the rollout contract :class:`RolloutEngine` (``update_weights`` / ``generate``,
  :class:`SamplingParams`) and its transformers implementation :class:`HFRollout`; GRPO advantages
  (:func:`grpo_outcome_advantage`) and verl's batch layout of a rollout (:func:`rollout_batch`); the GRPO loop of
  ``verl-engine grpo`` on the embedded arithmetic task (:class:`GRPORun`, :func:`run_grpo`), its engines in this
  process (:class:`InProcessWorkers`, torchrun) or in a Ray worker group (:class:`RayWorkers`).
* The SFT engine and loop of ``verl-engine train``: :class:`Engine` / :func:`build_engine`, :func:`train`,
  packed batches with static / dynamic CP (:class:`CPLayout`, :class:`PackedBatch`). The demo data of
  ``verl-engine train`` lives in :mod:`verl_engine.demo` (not part of the engine's API).

Names load on first use (PEP 562): importing the package does not import megatron-core, so spawned test
ranks and torch-only users start fast.
"""

from importlib import metadata as _metadata
from typing import Any

from verl_mcore_utils.compat import prepare_megatron_import

# Before any module of this package imports megatron-core (Python runs this file first): check the release
# and prepare a GPU-less machine.
prepare_megatron_import()

__version__ = _metadata.version("verl-engine")  # single source: pyproject.toml

_LAZY: dict[str, str] = {
    "Batch": "verl_engine.data",
    "CPLayout": "verl_engine.packed",
    "Engine": "verl_engine.engine",
    "GRPORun": "verl_engine.grpo_run",
    "InProcessWorkers": "verl_engine.grpo_run",
    "RayWorkers": "verl_engine.grpo_run",
    "HFRollout": "verl_engine.rollout",
    "MicroBatching": "verl_engine.rl_engine",
    "PackedBatch": "verl_engine.packed",
    "RLBatch": "verl_engine.rl_batch",
    "RLEngine": "verl_engine.rl_engine",
    "RolloutEngine": "verl_engine.rollout",
    "RunSummary": "verl_engine.trainer",
    "SamplingParams": "verl_engine.rollout",
    "StepMetrics": "verl_engine.engine",
    "build_engine": "verl_engine.engine",
    "build_rl_engine": "verl_engine.build_rl",
    "cp_layout_from_config": "verl_engine.packed",
    "grpo_outcome_advantage": "verl_engine.grpo",
    "lr_at_step": "verl_engine.engine",
    "masked_loss_sum": "verl_engine.loss",
    "resolve_device": "verl_engine.trainer",
    "rl_engine_from_config": "verl_engine.build_rl",
    "rollout_batch": "verl_engine.grpo",
    "run_grpo": "verl_engine.grpo_run",
    "split_packed_micro_batches": "verl_engine.packed",
    "train": "verl_engine.trainer",
    "vocab_parallel_log_probs_and_entropy": "verl_engine.logprobs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'verl_engine' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = sorted(_LAZY)
